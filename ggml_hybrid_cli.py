"""The ``ggml-hybrid`` console script: a Ctrl-C at any moment, imports included, ends without a traceback.

It lives outside the package on purpose: importing ``ggml_hybrid`` loads the native module and
every layer (most of a second), and a Ctrl-C in that time would otherwise print the interpreter's
traceback. At import it only takes SIGINT (held for main()): import it to run the command, nothing else.
"""

from __future__ import annotations

import signal
import sys


def _interrupted() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while winding down does nothing
    sys.stderr.write("interrupted\n")
    sys.exit(130)


# A Ctrl-C is held from this module's import until the package's imports are done: raised inside a C
# extension's import (numpy's), it surfaces as an ImportError with a traceback instead of a
# KeyboardInterrupt. Installed at import, not in main(): one arriving as main() is entered, before its
# ``try``, would otherwise print the interpreter's traceback (seen under load).
_held: list[int] = []
try:
    signal.signal(signal.SIGINT, lambda signum, frame: _held.append(signum))
except KeyboardInterrupt:  # one that arrived before the handler took over
    _interrupted()


def main() -> None:
    try:
        from ggml_hybrid.cli.main import main as cli

        signal.signal(signal.SIGINT, signal.default_int_handler)
        if _held:
            raise KeyboardInterrupt
        cli()
    except KeyboardInterrupt:  # one that arrived outside the command (the group handles the rest)
        _interrupted()


if __name__ == "__main__":
    main()
