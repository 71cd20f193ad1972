"""Killing a quantize at any moment loses nothing: SIGKILL, SIGTERM and SIGINT at several points of
a real `qtool quantize` of a ~200 MB checkpoint (while it imports, as its staging folder
appears, and twice while it writes). Afterwards the final path holds nothing or the complete
output, the input is unchanged, a SIGTERM or SIGINT run cleaned up after itself (exit 143 or
130, one line, no traceback), and whatever a SIGKILL left is gone after the next run.

FP8 runs on torch (~2 s here, most of it writing), so the signals land inside the run; the last
test checks that most of them did, so the test cannot pass by signalling finished runs."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import wait_for_qtool_handlers

ROOT = Path(__file__).resolve().parent.parent
LAYERS, ROWS, COLS = 12, 2048, 4096  # 12 bf16 weights of 16 MiB: ~200 MB


def _write_model(folder: Path) -> None:
    """A plain bf16 safetensors model, written without torch."""
    folder.mkdir()
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(LAYERS)]
    size = ROWS * COLS * 2
    header = {name: {"dtype": "BF16", "shape": [ROWS, COLS], "data_offsets": [i * size, (i + 1) * size]} for i, name in enumerate(names)}
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
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, str, str]:
    """The model, its digest, and the digest of a complete output."""
    root = tmp_path_factory.mktemp("kill")
    folder = root / "model"
    _write_model(folder)
    reference = root / "reference"
    finished = _quantize(folder, reference)
    _, err = finished.communicate(timeout=300)
    assert finished.returncode == 0, err
    return folder, _digest(folder), _digest(reference)


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".qtool-tmp-" in p.name)


def _wait_for_staging(parent: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not _leftovers(parent) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)


INTERRUPTED: list[bool] = []  # per run: did the signal land before the run finished?


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["KILL", "TERM", "INT"])
@pytest.mark.parametrize("point", ["importing", "staged", "writing", "late"])
def test_a_killed_quantize_leaves_nothing_or_everything(tmp_path, model, sig, point):
    folder, model_digest, complete_digest = model
    out = tmp_path / "out"
    process = _quantize(folder, out)
    if point == "importing":  # once qtool's first handler is in (the interpreter's own start-up before it is not ours)
        wait_for_qtool_handlers(process)
        time.sleep(0.005)
    else:
        _wait_for_staging(tmp_path, process)
        time.sleep({"staged": 0.0, "writing": 0.3, "late": 1.0}[point])
    process.send_signal(sig)
    _, err = process.communicate(timeout=120)
    code = process.returncode
    INTERRUPTED.append(code != 0)

    assert _digest(folder) == model_digest, "the input changed"
    if out.exists():
        assert _digest(out) == complete_digest, "a partial output sits under the final name"
    assert "Traceback" not in err, err
    if sig == signal.SIGTERM:
        assert code in (0, 143), (code, err)
    elif sig == signal.SIGINT:
        assert code in (0, 130), (code, err)
    if sig != signal.SIGKILL:
        assert _leftovers(tmp_path) == [], "an interrupted run left its staging behind"
        if code:
            assert err.strip().splitlines()[-1].startswith("error: "), err

    # whatever a SIGKILL left behind, the next run in the same folder removes
    after = _quantize(folder, tmp_path / "next")
    _, err = after.communicate(timeout=300)
    assert after.returncode == 0, err
    assert _leftovers(tmp_path) == []
    assert _digest(tmp_path / "next") == complete_digest


def test_the_signals_landed_inside_the_runs():
    assert len(INTERRUPTED) == 12 and sum(INTERRUPTED) >= 9, INTERRUPTED
