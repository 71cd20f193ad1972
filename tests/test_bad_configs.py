"""Issue 10's JSON findings, each through the real `qtool inspect`: a side file or metadata JSON
that breaks qtool's limits, or a config field of the wrong JSON type, is exit 2 with one
`error: <file>: <field> ...` line and a hint; a per-tensor record qtool can't read, or a scale
no kernel reads, leaves its tensors plain with a note (exit 0), and dequantize copies them.

Before the fix each case ended in a traceback (exit 1, later 70): ValueError (an integer over
4,300 digits), RecursionError, TypeError (`"ignore": 5`), ZeroDivisionError
(`"block_structure": [0, 0]`), or a shape error in decode (an F6 scale or zero point).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.errors import CheckpointError
from tests.conftest import write_safetensors

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("QTOOL_DEBUG", raising=False)


# -- checkpoints --------------------------------------------------------------------------------------

CT_FP8 = {"m.weight": ("F8_E4M3", [4, 32]), "m.weight_scale": ("BF16", [4, 1])}  # float-quantized, per channel
FP8_BLOCK = {"m.weight": ("F8_E4M3", [256, 256]), "m.weight_scale_inv": ("F32", [2, 2])}
GPT_OSS = {"m_blocks": ("U8", [2, 4, 16]), "m_scales": ("U8", [2, 4])}
MLX = {"m.weight": ("U32", [4, 8]), "m.scales": ("F16", [4, 1]), "m.biases": ("F16", [4, 1])}
GPTQ = {
    "m.qweight": ("I32", [16, 64]),
    "m.scales": ("F16", [1, 64]),
    "m.qzeros": ("I32", [1, 8]),
    "m.g_idx": ("I32", [128]),
}
QUANTO = {"m.weight._data": ("I8", [4, 8]), "m.weight._scale": ("F32", [4, 1])}
TORCHAO = {"0._weight_qdata": ("I8", [4, 8]), "0._weight_scale": ("F32", [4, 1])}


def ct_config(weights: Any = None, **fields: Any) -> dict[str, Any]:
    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"} if weights is None else weights,
    }
    group.update(fields.pop("group", {}))
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": group},
            **fields,
        }
    }


def folder(tmp: Path, tensors: dict, side: str, content: Any) -> tuple[Path, Path]:
    """A model folder with one weights file and one side file; (what to pass, the side file).
    With an index as the side file the weights are a shard, so the folder is read through it."""
    model = tmp / "model"
    weights = "model-00001-of-00001.safetensors" if side.endswith(".index.json") else "model.safetensors"
    write_safetensors(model / weights, tensors)
    path = model / side
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return model, path


def single_file(tmp: Path, tensors: dict, metadata: dict[str, str]) -> tuple[Path, Path]:
    path = write_safetensors(tmp / "model.safetensors", tensors, metadata=metadata)
    return path, path


HUGE = "1" * 5000  # over Python's 4,300-digit int() limit
DEEP = "[" * 100_000 + "]" * 100_000

# name -> (build(tmp) -> (argument, file named), the rest of the error line after "<file>: ")
REFUSED: dict[str, tuple[Callable[[Path], tuple[Path, Path]], str]] = {
    "config.json huge int": (
        lambda tmp: folder(tmp, CT_FP8, "config.json", '{"vocab_size": ' + HUGE + "}"),
        "holds an integer of 5000 digits (at most 40)",
    ),
    "quantize_config.json huge int": (
        lambda tmp: folder(tmp, GPTQ, "quantize_config.json", '{"bits": ' + HUGE + "}"),
        "holds an integer of 5000 digits (at most 40)",
    ),
    "quanto map huge int": (
        lambda tmp: folder(tmp, QUANTO, "quanto_qmap.json", '{"m": {"weights": ' + HUGE + "}}"),
        "holds an integer of 5000 digits (at most 40)",
    ),
    "index huge int": (
        lambda tmp: folder(
            tmp, CT_FP8, "model.safetensors.index.json", '{"metadata": {"total_size": ' + HUGE + '}, "weight_map": {}}'
        ),
        "holds an integer of 5000 digits (at most 40)",
    ),
    "config.json deep": (
        lambda tmp: folder(tmp, CT_FP8, "config.json", DEEP),
        "nests deeper than 64 levels",
    ),
    "config.json lone surrogate": (  # would reach a note, --json and a written config.json, and fail there
        lambda tmp: folder(tmp, CT_FP8, "config.json", ct_config(format="\ud800")),
        'holds the string "\\ud800", whose lone UTF-16 surrogate is not Unicode text',  # escaped once (issue 42 #12)
    ),
    "config.json 1e400": (
        lambda tmp: folder(tmp, CT_FP8, "config.json", '{"rope_theta": 1e400}'),
        "holds the number 1e400, which overflows a double",
    ),
    "ct metadata deep": (
        lambda tmp: single_file(tmp, CT_FP8, {"quantization_config": DEEP}),
        '__metadata__["quantization_config"] nests deeper than 64 levels',
    ),
    "ct metadata huge int": (
        lambda tmp: single_file(
            tmp, CT_FP8, {"quantization_config": '{"quant_method": "compressed-tensors", "x": ' + HUGE + "}"}
        ),
        '__metadata__["quantization_config"] holds an integer of 5000 digits (at most 40)',
    ),
    "ct metadata wrong type": (
        lambda tmp: single_file(
            tmp, CT_FP8, {"quantization_config": json.dumps(ct_config(ignore=5)["quantization_config"])}
        ),
        '__metadata__["quantization_config"].ignore is 5, expected a list of strings',
    ),
    "ct ignore 5": (
        lambda tmp: folder(tmp, CT_FP8, "config.json", ct_config(ignore=5)),
        "quantization_config.ignore is 5, expected a list of strings",
    ),
    "ct targets 255": (
        lambda tmp: folder(tmp, CT_FP8, "config.json", ct_config(group={"targets": 255})),
        "quantization_config.config_groups.group_0.targets is 255, expected a list of strings",
    ),
    "ct weights 5": (
        lambda tmp: folder(tmp, CT_FP8, "config.json", ct_config(weights=5)),
        "quantization_config.config_groups.group_0.weights is 5, expected an object",
    ),
    "ct strategy list": (
        lambda tmp: folder(tmp, CT_FP8, "config.json", ct_config(weights={"strategy": ["x"]})),
        'quantization_config.config_groups.group_0.weights.strategy is ["x"], expected a string',
    ),
    "ct block_structure 0x0": (
        lambda tmp: folder(
            tmp, CT_FP8, "config.json", ct_config(weights={"strategy": "block", "block_structure": [0, 0]})
        ),
        "quantization_config.config_groups.group_0.weights.block_structure[0] is 0, expected an integer ≥ 1",
    ),
    "ct block_structure text": (
        lambda tmp: folder(
            tmp, CT_FP8, "config.json", ct_config(weights={"strategy": "block", "block_structure": "0x4"})
        ),
        'quantization_config.config_groups.group_0.weights.block_structure is "0x4", expected a list of 2 integers ≥ 1, or "<rows>x<cols>"',
    ),
    "fp8 weight_block_size 0": (
        lambda tmp: folder(
            tmp, FP8_BLOCK, "config.json", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 0]}}
        ),
        "quantization_config.weight_block_size[0] is 0, expected an integer ≥ 1",
    ),
    "fp8 modules_to_not_convert object": (
        lambda tmp: folder(
            tmp,
            GPT_OSS,
            "config.json",
            {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [{}]}},
        ),
        "quantization_config.modules_to_not_convert[0] is {}, expected a string",
    ),
    "mlx mode object": (
        lambda tmp: folder(tmp, MLX, "config.json", {"quantization": {"group_size": 64, "bits": 4, "mode": {}}}),
        "quantization.mode is {}, expected a string",
    ),
    "mlx per-module bits": (
        lambda tmp: folder(
            tmp, MLX, "config.json", {"quantization": {"group_size": 64, "bits": 4, "m": {"bits": "4"}}}
        ),
        'quantization.m.bits is "4", expected an integer from 1 to 32',
    ),
    "gptq bits string": (
        lambda tmp: folder(tmp, GPTQ, "quantize_config.json", {"bits": "4", "group_size": 128}),
        'bits is "4", expected an integer',
    ),
    "awq zero_point string": (
        lambda tmp: folder(
            tmp, GPTQ, "config.json", {"quantization_config": {"quant_method": "awq", "zero_point": "yes"}}
        ),
        'quantization_config.zero_point is "yes", expected true or false',
    ),
    "quanto map list": (
        lambda tmp: folder(tmp, QUANTO, "quanto_qmap.json", [1, 2]),
        "holds [1, 2], expected an object",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_bad_json_is_one_error_line_and_exit_2(tmp_path, case):
    build, message = REFUSED[case]
    arg, named = build(tmp_path)
    result = runner.invoke(app, ["inspect", str(arg)])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == f"error: {named}: {message}"
    assert len(lines) == 2 and lines[1].startswith("hint: ") and "Traceback" not in result.stderr
    with pytest.raises(CheckpointError):
        qtool.inspect(arg)


def test_through_a_real_process(tmp_path):
    arg, named = folder(tmp_path, CT_FP8, "config.json", '{"vocab_size": ' + HUGE + "}")
    env = {k: v for k, v in os.environ.items() if k != "QTOOL_DEBUG"}
    result = subprocess.run(
        [sys.executable, "-m", "qtool", "inspect", str(arg)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: {named}: holds an integer of 5000 digits (at most 40)",
        "hint: fix or remove the file",
    ]


# -- per-tensor records and scales: plain with a note, exit 0 -----------------------------------------


def torchao_record(data_names: Any = ("qdata", "scale"), **data: Any) -> dict[str, str]:
    record = {"_type": "IntxUnpackedToInt8Tensor", "_tensor_data_names": list(data_names) if isinstance(data_names, tuple) else data_names,
              "_data": {"block_size": [1, 8], "shape": [4, 8], "dtype": "float32", **data}}  # fmt: skip
    return {"tensor_names": '["0.weight"]', "0.weight": json.dumps(record)}


NOTED: dict[str, tuple[Callable[[Path], tuple[Path, Path]], str | None]] = {
    "torchao _tensor_data_names 5": (
        lambda tmp: single_file(tmp, TORCHAO, torchao_record(5)),
        'torchao record 0.weight: __metadata__["0.weight"]._tensor_data_names is 5, expected a list of strings; left plain',
    ),
    "torchao shape strings": (
        lambda tmp: single_file(tmp, TORCHAO, torchao_record(shape=["4", "8"])),
        'torchao record 0.weight: __metadata__["0.weight"]._data.shape[0] is "4", expected an integer ≥ 0; left plain',
    ),
    "torchao target_dtype junk": (
        lambda tmp: single_file(tmp, TORCHAO, torchao_record(target_dtype="intfoo")),
        "looks like a torchao IntxUnpackedToInt8Tensor, but target_dtype 'intfoo' is not int1..int8 or uint1..uint8; left plain",
    ),
    "torchao F6 zero point": (
        lambda tmp: single_file(
            tmp,
            {**TORCHAO, "0._weight_zero_point": ("F6_E3M2", [4, 1])},
            torchao_record(("qdata", "scale", "zero_point")),
        ),
        "looks like a torchao IntxUnpackedToInt8Tensor, but zero_point is F6_E3M2, which no toolchain stores zero points as (an integer or a float); left plain",
    ),
    "torchao tensor_names deep": (  # not JSON within limits: not torchao's, ignored
        lambda tmp: single_file(tmp, TORCHAO, {"tensor_names": DEEP}),
        None,
    ),
    "ct F6 scale": (
        lambda tmp: folder(
            tmp, {"m.weight": ("F8_E4M3", [4, 32]), "m.weight_scale": ("F6_E3M2", [4, 1])}, "config.json", ct_config()
        ),
        "looks like compressed-tensors, but weight_scale is F6_E3M2, which no toolchain stores scales as (a float, or U8/F8_E8M0 for E8M0); left plain",
    ),
    "fp8 F4 scale": (
        lambda tmp: folder(
            tmp, {"m.weight": ("F8_E4M3", [4, 32]), "m.weight_scale": ("F4", [4, 1])}, "config.json", {}
        ),
        "looks like an fp8 weight, but weight_scale F4 [4, 1] does not fit a [4, 32] weight; left plain",
    ),
}


@pytest.mark.parametrize("case", list(NOTED), ids=list(NOTED))
def test_a_record_or_scale_qtool_cannot_read_stays_plain_with_a_note(tmp_path, case):
    build, note = NOTED[case]
    arg, _ = build(tmp_path)
    result = runner.invoke(app, ["inspect", str(arg), "--json"])
    assert result.exit_code == 0, result.output
    weights = json.loads(result.stdout)["weights"]
    assert all(w["scheme"] is None for w in weights)
    if note is not None:
        assert all(w["notes"] == [note] for w in weights), weights
    # and dequantize copies them as they are, where it used to fail in decode
    out = tmp_path / "out.safetensors"
    result = runner.invoke(app, ["dequantize", str(arg), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.exists()


def test_a_usable_type_with_an_unusable_value_is_still_a_note(tmp_path):
    # GPTQ's established rule: bits 5 is the right type, fits no GPTQ width, the shapes decide
    arg, _ = folder(tmp_path, GPTQ, "quantize_config.json", {"bits": 5, "group_size": 128})
    result = runner.invoke(app, ["inspect", str(arg), "--json"])
    assert result.exit_code == 0, result.output
    notes = [n for w in json.loads(result.stdout)["weights"] for n in w["notes"]]
    assert any("quantize_config.json says bits 5, not a GPTQ width" in n for n in notes), notes


def test_nan_and_infinity_read_as_python_writes_them(tmp_path):
    # json.dumps writes NaN/Infinity and transformers reads them back: so does qtool
    arg, _ = folder(tmp_path, CT_FP8, "config.json", '{"rope_scaling": {"factor": Infinity}, "x": NaN}')
    assert runner.invoke(app, ["inspect", str(arg)]).exit_code == 0


def test_block_structure_in_its_old_text_spelling_is_read(tmp_path):
    # compressed-tensors still accepts "100x100" for [100, 100]; so does qtool. The scale's
    # [3, 2] grid alone fits no block along 256 rows: only the config's block reads it.
    tensors = {"m.weight": ("F8_E4M3", [256, 200]), "m.weight_scale": ("F32", [3, 2])}
    arg, _ = folder(
        tmp_path,
        tensors,
        "config.json",
        ct_config(weights={"type": "float", "num_bits": 8, "strategy": "block", "block_structure": "100x100"}),
    )
    result = runner.invoke(app, ["inspect", str(arg), "--json"])
    assert result.exit_code == 0, result.output
    (weight,) = json.loads(result.stdout)["weights"]
    assert weight["scheme"]["block"] == [100, 100], weight
