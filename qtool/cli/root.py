"""The root command group: the commands, `--version`, shell completion, and the commands' error
boundary. Imported by `qtool.cli.main` after it has installed the signal handlers, since typer
alone costs ~25 ms to import."""

from __future__ import annotations

import importlib
import sys

import typer
from typer.core import TyperGroup

from qtool.cli import COMMANDS, debug, report, stopped
from qtool.cli.text import paragraphs
from qtool.errors import Terminated

__all__ = ["build_app"]


def _is_click_exception(exc: BaseException) -> bool:
    """Click's and Typer's own exceptions (usage errors, Exit, Abort) are theirs to handle. By the
    defining module, not by class: Typer vendors click (typer._click) in recent versions, and
    uses the click package in older ones; neither is public API to import."""
    return type(exc).__module__.partition(".")[0] in ("click", "typer")


class _ErrorBoundary(TyperGroup):
    """Every command runs inside this, in the CLI and under CliRunner alike: a QtoolError prints
    `error:` and `hint:` and exits with its code; any other exception is a bug (exit 70); Ctrl-C
    and SIGTERM exit 130 and 143. With QTOOL_DEBUG=1 errors propagate, and `qtool.cli.main`
    prints the traceback."""

    def invoke(self, ctx):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # `qtool inspect big | head`: not an error
            sys.stderr.close()
            ctx.exit(0)
        except (KeyboardInterrupt, Terminated) as exc:
            ctx.exit(stopped(exc))
        except Exception as exc:
            if _is_click_exception(exc) or debug():
                raise
            ctx.exit(report(exc))


def _print_version(value: bool) -> None:
    if value:
        from qtool.version import __version__

        typer.echo(f"qtool {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    """See inside model checkpoints, quantize and dequantize them, compare two and check one against a policy."""


def build_app(only: str | None = None) -> typer.Typer:
    """The `qtool` app with every command, or with `only` that one. Typer turns each registered
    command's signature into click parameters when the app runs (~25 ms for all six here, a
    tenth of `qtool inspect`), so a run imports and registers just the command it runs.
    Typer's completion (--install-completion, --show-completion, and answering the shell's
    _QTOOL_COMPLETE requests) costs ~0.3 ms of that: always on."""
    built = typer.Typer(
        name="qtool",
        cls=_ErrorBoundary,
        help="Inspect, quantize, dequantize, convert and compare model checkpoints (safetensors, GGUF, PyTorch pickles), and check "
        "one against a policy: every weight's shape, dtype and quantization scheme, in the layouts real loaders accept.",
        epilog="Exit codes: 0 ok, 1 a check found a violation, 2 bad usage or unreadable input, "
        "70 a bug in qtool, 130 interrupted, 143 terminated. Set QTOOL_DEBUG=1 for tracebacks.",
        no_args_is_help=True,
        add_completion=True,
        pretty_exceptions_show_locals=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    for name in COMMANDS:
        if only is None or name == only:
            module = importlib.import_module(f"qtool.cli.{name}")
            built.command(name, help=paragraphs(module.HELP))(getattr(module, f"{name}_command"))
    built.callback()(_root)
    return built
