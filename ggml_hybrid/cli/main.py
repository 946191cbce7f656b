"""The ``ggml-hybrid`` click group: every user error becomes one ``error:`` line and exit status 2."""

from __future__ import annotations

import sys

import click

from ..errors import GgmlHybridError


class _Group(click.Group):
    """Click's own usage errors, and ours, as one line and exit status 2."""

    def main(self, args=None, prog_name=None, **kw):  # type: ignore[override]  # never returns: exits
        try:
            rv = super().main(args=args, prog_name=prog_name or "ggml-hybrid", standalone_mode=False, **kw)
        except click.exceptions.NoArgsIsHelpError as exc:
            click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
            sys.exit(2)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            sys.exit(2)
        except click.exceptions.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(2)
        except (GgmlHybridError, OSError) as exc:
            click.echo(f"error: {' '.join(str(exc).split())}", err=True)
            sys.exit(2)
        sys.exit(rv or 0)



@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ggml-hybrid", prog_name="ggml-hybrid")
def main():
    """Run Mixture-of-Experts GGUF models with experts on disk, in a device cache, or on the CPU."""
