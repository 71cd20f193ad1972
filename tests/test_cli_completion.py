"""Shell completion as Typer offers it: --install-completion and --show-completion, and the
_QTOOL_COMPLETE requests a shell's completion script makes (Typer spells them `source_bash`,
`complete_bash`; click 8's `bash_source` spelling works too)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from qtool.cli import COMMANDS
from typer.testing import CliRunner

from qtool.cli import app
from tests.conftest import REPO


def qtool_with(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("_QTOOL", "_TYPER", "COMP_"))}
    environment.update(env, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "qtool", *args], capture_output=True, text=True, env=environment, cwd=REPO, timeout=60
    )


def test_help_offers_install_and_show_completion():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "--install-completion" in result.stdout and "--show-completion" in result.stdout


@pytest.mark.parametrize("request_", ["source_bash", "bash_source"])
def test_bash_script(request_):
    result = qtool_with({"_QTOOL_COMPLETE": request_})
    assert result.returncode == 0, result.stderr
    assert "complete -o default -F _qtool_completion qtool" in result.stdout
    assert "_QTOOL_COMPLETE=complete_bash" in result.stdout


def test_zsh_and_fish_scripts():
    zsh = qtool_with({"_QTOOL_COMPLETE": "source_zsh"})
    assert zsh.returncode == 0 and zsh.stdout.lstrip().startswith("#compdef qtool")
    fish = qtool_with({"_QTOOL_COMPLETE": "source_fish"})
    assert fish.returncode == 0 and "complete --command qtool" in fish.stdout


def test_completing_commands_and_options():
    assert qtool_with(
        {"_QTOOL_COMPLETE": "complete_bash", "COMP_WORDS": "qtool insp", "COMP_CWORD": "1"}
    ).stdout.split() == ["inspect"]
    assert qtool_with(
        {"_QTOOL_COMPLETE": "bash_complete", "COMP_WORDS": "qtool c", "COMP_CWORD": "1"}
    ).stdout.split() == [name for name in COMMANDS if name.startswith("c")]
    options = qtool_with(
        {"_QTOOL_COMPLETE": "complete_bash", "COMP_WORDS": "qtool inspect --fo", "COMP_CWORD": "2"}
    ).stdout.split()
    assert options == ["--format"]
    zsh = qtool_with({"_QTOOL_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "qtool sch"})
    assert '"schemes"' in zsh.stdout
    fish = qtool_with(
        {
            "_QTOOL_COMPLETE": "complete_fish",
            "_TYPER_COMPLETE_ARGS": "qtool deq",
            "_TYPER_COMPLETE_FISH_ACTION": "get-args",
        }
    )
    assert fish.stdout.startswith("dequantize\t")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_bash_script_completes_in_a_real_bash(tmp_path):
    """The script as a user installs it: eval'd in bash, calling `qtool` from PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "qtool").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m qtool "$@"\n')
    (bin_dir / "qtool").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    script = 'eval "$(_QTOOL_COMPLETE=source_bash qtool)"\nCOMP_WORDS=(qtool insp)\nCOMP_CWORD=1\n_qtool_completion qtool\necho "${COMPREPLY[@]}"\n'
    result = subprocess.run(
        ["bash", "--norc", "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["inspect"]
