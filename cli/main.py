"""`graphdiff` command line: a thin layer over the library (commands.py; options.py checks the options, render.py
prints); user errors become one line + exit 2."""

from __future__ import annotations

import sys

from graphdiff.capture.cpu_kind import apply_forced_kind
from graphdiff.errors import GraphdiffError

from .commands import app
from .render import print_error

__all__ = ["app", "main"]


def main() -> None:
    try:  # GRAPHDIFF_CPU_KIND: run as another kind of CPU (the other kernel path), before anything
        apply_forced_kind()
    except GraphdiffError as e:  # outside the app: typer.Exit would surface as a traceback here
        print_error(e)
        sys.exit(2)
    app()


if __name__ == "__main__":
    main()
