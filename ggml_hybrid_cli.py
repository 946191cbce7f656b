"""The ``ggml-hybrid`` console script: a Ctrl-C at any moment, imports included, ends without a traceback.

It lives outside the package on purpose: importing ``ggml_hybrid`` loads the native module and
every layer (most of a second), and a Ctrl-C in that time would otherwise print the interpreter's
traceback. Nothing here runs at import time but two standard-library imports.
"""

from __future__ import annotations

import signal
import sys


def _interrupted() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while winding down does nothing
    sys.stderr.write("interrupted\n")
    sys.exit(130)


def main() -> None:
    try:
        from ggml_hybrid.cli.main import main as cli
    except KeyboardInterrupt:
        _interrupted()
    try:
        cli()
    except KeyboardInterrupt:  # one that arrived outside the command (the group handles the rest)
        _interrupted()


if __name__ == "__main__":
    main()
