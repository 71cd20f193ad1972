"""`inspect --stats` and `check --no-nan` read plain weights with numpy, never torch, for every
dtype qtool lists; 8-bit floats through tables checked here against torch's own decoding."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from qtool.audit import count_non_finite
from qtool.cli import app
from qtool.dtypes import DTYPES
from qtool.plain_values import float8_table
from tests.conftest import REPO, SAMPLES, write_safetensors

runner = CliRunner()
FLOAT8 = ["F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0"]


@pytest.mark.parametrize("name", FLOAT8)
def test_float8_tables_decode_every_byte_as_torch_does(name):
    want = torch.frombuffer(bytearray(range(256)), dtype=DTYPES[name].torch_dtype()).double().numpy()
    got = float8_table(name)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


def test_the_shipped_traps_sample_passes_no_nan():
    """It holds a bare F8_E4M3 weight: torch has no isinf for Float8_e4m3fn (exit 70 before)."""
    result = runner.invoke(app, ["check", str(SAMPLES / "traps"), "--no-nan"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name", ["F8_E4M3", "F8_E5M2"])
def test_float8_nan_and_inf_are_counted(tmp_path, name):
    # E4M3FN: 0x7F is NaN and nothing is inf; E5M2: 0x7C is +inf and 0x7F NaN
    raw = bytes([0x38, 0x7F, 0x7C, 0x00])
    path = write_safetensors(tmp_path / "m.safetensors", {"w": (name, (4,))}, data={"w": raw})
    result = runner.invoke(app, ["check", str(path), "--no-nan", "--json"])
    assert result.exit_code == 1, result.output
    [finding] = json.loads(result.stdout)["findings"]
    want = "1 NaN and 0 Inf" if name == "F8_E4M3" else "1 NaN and 1 Inf"
    assert finding["detail"].startswith(want), finding
    stats = json.loads(runner.invoke(app, ["inspect", str(path), "--stats", "--json"]).stdout)["weights"][0]["stats"]
    assert (stats["nan"], stats["inf"]) == ((1, 0) if name == "F8_E4M3" else (1, 1))
    assert stats["max"] == (448.0 if name == "F8_E4M3" else 1.0) or stats["min"] == 0.0


def test_decoded_float8_tensors_are_counted_too():
    values = torch.tensor([1.0, float("nan"), 2.0]).to(torch.float8_e4m3fn)
    assert count_non_finite(values) == (1, 0)


@pytest.mark.parametrize("dtype", sorted(d for d in DTYPES if not d.startswith(("F4", "F6"))))
def test_stats_of_every_dtype_match_torch(tmp_path, dtype):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=64 * DTYPES[dtype].bits // 8, dtype=np.uint8).tobytes()
    if dtype == "BOOL":
        raw = bytes(b & 1 for b in raw)
    path = write_safetensors(tmp_path / "m.safetensors", {"w": (dtype, (64,))}, data={"w": raw})
    stats = json.loads(runner.invoke(app, ["inspect", str(path), "--stats", "--json"]).stdout)["weights"][0]["stats"]
    values = torch.frombuffer(bytearray(raw), dtype=DTYPES[dtype].torch_dtype())
    values = values.abs() if values.is_complex() else values
    values = values.double()
    finite = values[torch.isfinite(values)]
    assert stats["nan"] == int(torch.isnan(values).sum()) and stats["inf"] == int(torch.isinf(values).sum())
    exact = dtype != "C64"  # magnitudes: numpy's and torch's float32 hypot differ in the last bit
    assert stats["min"] == pytest.approx(float(finite.min()), rel=0 if exact else 1e-6)
    assert stats["max"] == pytest.approx(float(finite.max()), rel=0 if exact else 1e-6)
    assert stats["mean"] == pytest.approx(float(finite.mean()), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("command", [["inspect", "--stats", "--json"], ["check", "--no-nan"]], ids=" ".join)
@pytest.mark.parametrize("sample", ["tiny-llama", "traps"])
def test_stats_and_no_nan_import_no_torch(command, sample):
    code = (
        "import sys\nfrom qtool.cli import main\nsys.argv = ['qtool', sys.argv[1], sys.argv[2], *sys.argv[3:]]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, command[0], str(SAMPLES / sample), *command[1:]],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
