"""Killing a quantize at any moment loses nothing: SIGKILL, SIGTERM and SIGINT at several points of
a real `qtool quantize` of a ~200 MB checkpoint (while it imports, as its staging folder
appears, and twice while it writes). Afterwards the final path holds nothing or the complete
output, the input is unchanged, a SIGTERM or SIGINT run cleaned up after itself (exit 143 or
130, one line, no traceback), and whatever a SIGKILL left is gone after the next run.

Each signal is sent in a state the test sees (qtool's handlers in /proc; the staging folder; a
share of the output's bytes staged) with the process frozen there (`signal_when`), so every one
lands inside the run, however loaded the machine: a SIGTERM run always exits 143, a SIGINT run
130, a SIGKILL run by the signal. No test counts on another having run before it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.signal_helpers import default_signal_dispositions, qtool_handlers_in, signal_when

ROOT = Path(__file__).resolve().parent.parent
LAYERS, ROWS, COLS = 12, 2048, 4096  # 12 bf16 weights of 16 MiB: ~200 MB


def _write_model(folder: Path) -> None:
    """A plain bf16 safetensors model, written without torch."""
    folder.mkdir()
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(LAYERS)]
    size = ROWS * COLS * 2
    header = {
        name: {"dtype": "BF16", "shape": [ROWS, COLS], "data_offsets": [i * size, (i + 1) * size]}
        for i, name in enumerate(names)
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(0)
    with open(folder / "model.safetensors", "wb") as handle:
        handle.write(len(raw).to_bytes(8, "little") + raw)
        for _ in names:
            values = rng.standard_normal((ROWS, COLS), dtype=np.float32) * 0.02
            handle.write((values.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def _quantize(model: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("QTOOL_DEBUG", None)
    return subprocess.Popen(
        [sys.executable, "-m", "qtool", "quantize", str(model), "-o", str(out), "--scheme", "FP8", "-q"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True, preexec_fn=default_signal_dispositions,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, str, str, int]:
    """The model, its digest, the digest of a complete output, and that output's size."""
    root = tmp_path_factory.mktemp("kill")
    folder = root / "model"
    _write_model(folder)
    reference = root / "reference"
    finished = _quantize(folder, reference)
    _, err = finished.communicate(timeout=300)
    assert finished.returncode == 0, err
    return folder, _digest(folder), _digest(reference), _size(reference)


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".qtool-tmp-" in p.name)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _staged_bytes(parent: Path) -> int:
    """The bytes written under the staging folders so far."""
    total = 0
    for name in _leftovers(parent):
        try:
            total += _size(parent / name)
        except FileNotFoundError:  # it went (committed, or removed) as we looked
            continue
    return total


# where a signal lands: (share of the complete output's bytes staged; None: once qtool's handlers are in)
POINTS = {"importing": None, "staged": 0.0, "writing": 0.25, "late": 0.75}
EXIT = {signal.SIGKILL: -signal.SIGKILL, signal.SIGTERM: 143, signal.SIGINT: 130}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["KILL", "TERM", "INT"])
@pytest.mark.parametrize("point", list(POINTS))
def test_a_killed_quantize_leaves_nothing_or_everything(tmp_path, model, sig, point):
    folder, model_digest, complete_digest, complete_size = model
    out = tmp_path / "out"
    process = _quantize(folder, out)
    share = POINTS[point]
    if share is None:  # the interpreter's own start-up before qtool's first handler is not ours
        ready = lambda: qtool_handlers_in(process)  # noqa: E731
    else:
        ready = lambda: (_staged_bytes(tmp_path) if _leftovers(tmp_path) else -1) >= share * complete_size  # noqa: E731
    sent = signal_when(process, sig, ready)
    _, err = process.communicate(timeout=300)
    code = process.returncode

    assert sent, f"the run ended (exit {code}) before it reached {point!r}: {err}"
    assert (code, "Traceback" in err) == (EXIT[sig], False), err  # it landed inside the run, every time
    assert _digest(folder) == model_digest, "the input changed"
    if out.exists():
        assert _digest(out) == complete_digest, "a partial output sits under the final name"
    if sig != signal.SIGKILL:
        assert _leftovers(tmp_path) == [], "an interrupted run left its staging behind"
        assert err.strip().splitlines() == ["error: " + ("terminated" if sig == signal.SIGTERM else "interrupted")], err

    # whatever a SIGKILL left behind, the next run in the same folder removes
    after = _quantize(folder, tmp_path / "next")
    _, err = after.communicate(timeout=300)
    assert after.returncode == 0, err
    assert _leftovers(tmp_path) == []
    assert _digest(tmp_path / "next") == complete_digest
