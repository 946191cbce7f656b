"""The ``ggml-hybrid`` click group: every user error becomes one ``error:`` line and exit status 2.

Ctrl-C ends the command with exit status 130 and no traceback; a second Ctrl-C while the first
is being handled (stats printed, the model closed) is ignored.
"""

from __future__ import annotations

import signal
import sys
from typing import Any, NoReturn

import click

from ..errors import GgmlHybridError, shorten
from .flags import Command

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process that SIGINT ended


def ignore_interrupts() -> None:
    """From here on Ctrl-C does nothing: the process is already winding down after one."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread (an embedding host): nothing to do
        pass


def take_interrupts() -> None:
    """Ctrl-C raises KeyboardInterrupt whatever the process inherited.

    A shell starts a background job, ``nohup`` and some CI runners with SIGINT ignored, and Python then
    leaves it ignored: a Ctrl-C typed at the chat's prompt did nothing. cli.md promises exit status 130.
    """
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread (an embedding host): its signals are its own
        pass


def interrupted() -> NoReturn:
    ignore_interrupts()
    click.echo("interrupted", err=True)
    sys.exit(EXIT_INTERRUPTED)


class _Group(click.Group):
    """Click's own usage errors, and ours, as one line and exit status 2."""

    command_class = Command

    def main(self, args: Any = None, prog_name: str | None = None, **kw: Any) -> NoReturn:  # type: ignore[override]
        take_interrupts()
        try:
            rv = super().main(args=args, prog_name=prog_name or "ggml-hybrid", standalone_mode=False, **kw)
        except KeyboardInterrupt:
            interrupted()
        except click.exceptions.NoArgsIsHelpError as exc:
            click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
            sys.exit(2)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.ClickException as exc:  # one line, even where a message quotes a value with newlines
            click.echo(f"error: {shorten(' '.join(exc.format_message().split()))}", err=True)
            sys.exit(2)
        except click.exceptions.Abort as exc:
            if isinstance(exc.__cause__, KeyboardInterrupt):
                interrupted()
            click.echo("error: aborted (end of input)", err=True)
            sys.exit(2)
        except (GgmlHybridError, OSError) as exc:
            click.echo(f"error: {shorten(' '.join(str(exc).split()))}", err=True)
            sys.exit(2)
        sys.exit(rv or 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ggml-hybrid", prog_name="ggml-hybrid")
def main() -> None:
    """Run Mixture-of-Experts GGUF models with experts on disk, in a device cache, or on the CPU."""
