"""The one exception type users see: the CLI turns it into one line and exit code 2."""


import re

_NOISE = re.compile(r"\d+ validation errors? for |For further information")


class GraphdiffError(Exception):
    """An error the user can act on (bad input, missing dependency, unsupported model)."""


def first_line(e: BaseException) -> str:
    """The informative line of a library's exception, for a one-line user error (pydantic puts it
    after an 'N validation error for X' header and prefixes it with 'Value error, ')."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not _NOISE.match(ln.strip())]
    return re.sub(r"^Value error, ", "", lines[0]) if lines else type(e).__name__
