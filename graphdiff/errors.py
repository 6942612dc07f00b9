"""The one exception type users see: the CLI turns it into one line and exit code 2."""


class GraphdiffError(Exception):
    """An error the user can act on (bad input, missing dependency, unsupported model)."""
