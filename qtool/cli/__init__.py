"""The `qtool` command. One error boundary: a `QtoolError` becomes `error: ...` plus a hint on
stderr and its exit code; a traceback appears only with QTOOL_DEBUG=1."""

from __future__ import annotations

import os
import sys

import typer
from typer.core import TyperGroup

from qtool.cli import check, compare, dequantize, inspect, quantize, schemes
from qtool.cli.output import print_error
from qtool.cli.text import paragraphs
from qtool.errors import QtoolError

__all__ = ["app", "main"]

DEBUG_ENV = "QTOOL_DEBUG"


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class _ErrorBoundary(TyperGroup):
    """Catches qtool's expected errors for every command, in the CLI and under CliRunner alike."""

    def invoke(self, ctx):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except QtoolError as exc:
            if _debug():
                raise
            print_error(str(exc), exc.hint)
            ctx.exit(exc.exit_code)
        except BrokenPipeError:  # `qtool inspect big | head`: not an error
            sys.stderr.close()
            ctx.exit(0)


app = typer.Typer(
    name="qtool",
    cls=_ErrorBoundary,
    help="See inside model checkpoints: every weight's shape, dtype and quantization scheme.",
    epilog="Exit codes: 0 ok, 1 a check found a violation, 2 bad usage or unreadable input. "
    "Set QTOOL_DEBUG=1 for tracebacks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("inspect", help=paragraphs(inspect.HELP))(inspect.inspect_command)
app.command("quantize", help=paragraphs(quantize.HELP))(quantize.quantize_command)
app.command("dequantize", help=paragraphs(dequantize.HELP))(dequantize.dequantize_command)
app.command("schemes", help=paragraphs(schemes.HELP))(schemes.schemes_command)
app.command("compare", help=paragraphs(compare.HELP))(compare.compare_command)
app.command("check", help=paragraphs(check.HELP))(check.check_command)


def _print_version(value: bool) -> None:
    if value:
        from qtool import __version__

        typer.echo(f"qtool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    """See inside model checkpoints: every weight's shape, dtype and quantization scheme."""


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        print_error("interrupted")
        sys.exit(130)
    except QtoolError as exc:  # raised outside a command, or re-raised under QTOOL_DEBUG
        if _debug():
            raise
        print_error(str(exc), exc.hint)
        sys.exit(exc.exit_code)
