"""Every command prints through the same options: -f/--format (auto, table, json, tsv, names)
and --json, declared once in qtool.cli.options."""

from __future__ import annotations

import json

import pytest
import typer.main
from typer.testing import CliRunner

from qtool.cli import COMMANDS, app

runner = CliRunner()
FORMAT_HELP = "How to print: table, json, tsv or names. auto = a table on a terminal, else TSV."
JSON_HELP = "Print JSON: the same as --format json."


def _params(command: str) -> dict[str, object]:
    group = typer.main.get_command(app)
    return {param.name: param for param in group.commands[command].params}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_the_same_print_options(command):
    params = _params(command)
    fmt = params["fmt"]
    assert sorted(fmt.opts) == ["--format", "-f"]
    assert list(fmt.type.choices) == ["auto", "table", "json", "tsv", "names"]
    assert fmt.default == "auto" or getattr(fmt.default, "value", None) == "auto"
    assert fmt.help == FORMAT_HELP
    assert params["json_"].opts == ["--json"] and params["json_"].help == JSON_HELP


@pytest.mark.parametrize("fmt", ["json", "tsv", "names", "table"])
def test_schemes_prints_in_every_format(fmt):
    result = runner.invoke(app, ["schemes", "-f", fmt])
    assert result.exit_code == 0, result.output
    if fmt == "json":
        assert json.loads(result.stdout) == json.loads(runner.invoke(app, ["schemes", "--json"]).stdout)
    elif fmt == "names":
        assert result.stdout.splitlines()[:2] == ["W8A16", "W4A16"]
    elif fmt == "tsv":
        assert result.stdout.splitlines()[0] == "name\tscheme\tbits/weight\twrites\twhat it is"


def test_the_help_says_what_qtool_does_and_where_quantize_writes():
    """Issue 18 #16: the top-level help spoke only of inspecting; -o's help never named .gguf."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**os.environ, "COLUMNS": "300", "NO_COLOR": "1"}
    top = subprocess.run(
        [sys.executable, "-m", "qtool", "--help"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    ).stdout
    summary = top.split("Options")[0]
    for verb in ("Inspect", "quantize", "dequantize", "compare", "check"):
        assert verb in summary, verb
    quantize = subprocess.run(
        [sys.executable, "-m", "qtool", "quantize", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    ).stdout
    output_line = next(line for line in quantize.splitlines() if "--output" in line)
    assert ".gguf" in output_line and ".safetensors" in output_line
