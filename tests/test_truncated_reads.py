"""An input that shrinks while qtool streams its data (another process truncating it) is one
line and exit 2, never SIGBUS (exit 135): the data readers pread, and a short read names the
file. Each case runs the real CLI in a subprocess, with the file truncated right after the
first read of tensor data, wherever that read happens."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.conftest import REPO, SAMPLES, write_safetensors

# Truncate `path` right after the first read of tensor data, through either reader.
HARNESS = textwrap.dedent(
    """
    import os, sys
    import qtool.formats.checkpoint as checkpoint
    import qtool.value_stats

    qtool.value_stats.CHUNK = 1024  # many chunks: the file shrinks between two of them
    victims = sys.argv[1].split(",")

    def shrinking(method):
        def wrapped(self, tensor, *args, **kwargs):
            result = method(self, tensor, *args, **kwargs)
            for victim in victims:
                if os.path.getsize(victim) > 4096:
                    os.truncate(victim, 4096)
            return result
        return wrapped

    checkpoint.Checkpoint.read_bytes = shrinking(checkpoint.Checkpoint.read_bytes)
    checkpoint.Checkpoint.load = shrinking(checkpoint.Checkpoint.load)
    from qtool.cli import main

    sys.argv = ["qtool", *sys.argv[2:]]
    main()
    """
)


def _run(victims: list, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", HARNESS, ",".join(str(v) for v in victims), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


@pytest.fixture
def plain(tmp_path):
    values = np.linspace(-1, 1, 64 * 1024, dtype=np.float32)
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {"w": ("F32", (64, 1024))}, data={"w": values.tobytes()})
    return path


@pytest.mark.parametrize("command", [["inspect", "--stats"], ["check", "--no-nan"]], ids=" ".join)
def test_a_plain_input_truncated_while_it_is_read(plain, command):
    result = _run([plain], command[0], str(plain), command[1])
    assert result.returncode == 2, (result.returncode, result.stderr)
    first, *rest = result.stderr.splitlines()
    assert first.startswith(f"error: {plain}: tensor 'w' is cut short: it ends at byte "), first
    assert "the file at 4096" in first and all(line.startswith("hint:") for line in rest)
    assert result.stdout == ""


def test_a_quantized_input_truncated_while_it_is_decoded(tmp_path):
    model = tmp_path / "w4a16"
    shutil.copytree(SAMPLES / "tiny-llama-w4a16", model)
    [weights] = list(model.glob("*.safetensors"))
    result = _run([weights], "check", str(model), "--no-nan")
    assert result.returncode == 2, (result.returncode, result.stderr)
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"error: {weights}: tensor ") and "is cut short" in first, first


def test_dequantize_of_a_truncated_input(tmp_path):
    model = tmp_path / "w4a16"
    shutil.copytree(SAMPLES / "tiny-llama-w4a16", model)
    [weights] = list(model.glob("*.safetensors"))
    result = _run([weights], "dequantize", str(model), "-o", str(tmp_path / "out.safetensors"), "-q")
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert (
        "is cut short" in result.stderr.splitlines()[0] or "changed while it was read" in result.stderr.splitlines()[0]
    )
    assert not (tmp_path / "out.safetensors").exists()
