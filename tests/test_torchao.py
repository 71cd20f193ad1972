"""torchao: the prototype safetensors layout and `.pt` pickles of Int8Tensor, Float8Tensor,
IntxUnpackedToInt8Tensor and Int4Tensor, decoded bit for bit as torchao's own `dequantize()`.

Fixtures: tests/fixtures/torchao/, written by torchao 0.18 on CPU; the reference is torchao's
dequantize() (Int4Tensor: mslk's formula, which has no CPU path in torchao).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.conventions import decoder_for
from tests.conftest import REPO, write_safetensors

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "torchao"
REFERENCE = FIXTURES / "reference" / "weights.safetensors"
runner = CliRunner()

# name -> (label, torchao type, bits per weight)
EXPECTED = {
    "int8.weight": ("int8 sym channel", "Int8Tensor", (32 * 64 + 32 * 4 + 32) * 8 / (32 * 64)),
    "fp8.weight": ("fp8_e4m3 channel", "Float8Tensor", (32 * 64 + 32 * 4) * 8 / (32 * 64)),
    "intx4.weight": ("int4 sym g32", "IntxUnpackedToInt8Tensor", (32 * 64 + 32 * 2 * 2 + 32 * 2) * 8 / (32 * 64)),
    "int4.weight": ("int4 asym g32", "Int4Tensor", (32 * 32 + 2 * 32 * 2 * 2) * 8 / (32 * 64)),
}


def has_torchao() -> bool:
    try:
        import torchao  # noqa: F401
    except ImportError:
        return False
    return True


needs_torchao = pytest.mark.skipif(not has_torchao(), reason="torchao is not installed")


def float_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def decode_all(path) -> dict[str, torch.Tensor]:
    inspection = qtool.inspect(path)
    return {w.name: decoder_for(w).decode(inspection.checkpoint, w, "cpu") for w in inspection.weights if w.quantized}


CONTAINERS = [
    pytest.param("model.safetensors", id="safetensors"),
    pytest.param("model.pt", id="pickle", marks=needs_torchao),
]


@pytest.mark.parametrize("fixture", CONTAINERS)
def test_each_subclass_is_one_weight_with_its_scheme(fixture):
    found = {w.name: w for w in qtool.inspect(FIXTURES / fixture).weights}
    assert {n for n, w in found.items() if w.quantized} == set(EXPECTED)
    for name, (label, kind, bits) in EXPECTED.items():
        weight = found[name]
        assert weight.convention == "torchao"
        assert weight.scheme.label == label, name
        assert dict(weight.provenance.details)["torchao_type"] == kind
        assert (weight.shape, weight.parameters, weight.dtype) == ((32, 64), 2048, "BF16"), name
        assert weight.bits_per_weight == pytest.approx(bits), name
    assert found["int8.weight"].scheme.zero_point  # the all-zero zero point Int8Tensor writes
    assert found["int4.weight"].data.shape == (32, 32)  # two int4 a byte
    assert all(found[f"{n}.bias"].scheme is None for n in ("int8", "fp8", "intx4"))


@pytest.mark.parametrize("fixture", CONTAINERS)
def test_decoding_matches_torchao_bit_for_bit(fixture):
    expected = load_file(REFERENCE)
    decoded = decode_all(FIXTURES / fixture)
    assert set(decoded) == set(EXPECTED)
    for name, out in decoded.items():
        assert out.dtype == torch.bfloat16 and out.shape == expected[name].shape
        assert torch.equal(float_bits(out), float_bits(expected[name])), name
    # Int4Tensor's reference is mslk's formula; it stays within half a step of the original
    step = (
        expected["int4.original"].float().reshape(32, 2, 32).amax(-1)
        - expected["int4.original"].float().reshape(32, 2, 32).amin(-1)
    ) / 15
    error = (expected["int4.weight"].float() - expected["int4.original"].float()).abs().reshape(32, 2, 32)
    assert bool((error <= step.unsqueeze(-1) * 0.5 + 0.02).all())


def test_inspect_json_on_the_safetensors_layout():
    result = runner.invoke(app, ["inspect", str(FIXTURES / "model.safetensors"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["format"] == "safetensors"
    assert "torchao" in doc["conventions"]
    by_name = {w["name"]: w for w in doc["weights"]}
    assert by_name["intx4.weight"]["scheme"]["group_size"] == 32
    assert {t["role"] for t in by_name["intx4.weight"]["tensors"]} == {"data", "scale", "zero_point"}


@needs_torchao
def test_inspect_json_on_the_pickle_says_torch():
    result = runner.invoke(app, ["inspect", str(FIXTURES / "model.pt"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["format"] == "torch" and doc["summary"]["quantized_weights"] == 4


@needs_torchao
@pytest.mark.parametrize("kind", ["int8", "fp8", "intx4", "intx2_asym"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_live_torchao_round_trip(tmp_path, kind, dtype):
    """Quantize with torchao here, save both ways, and decode as torchao's dequantize() does."""
    import logging

    logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
    from torchao.quantization import (
        Float8WeightOnlyConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
        MappingType,
        PerGroup,
        quantize_,
    )

    configs = {
        "int8": Int8WeightOnlyConfig(),
        "fp8": Float8WeightOnlyConfig(),
        "intx4": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)),
        "intx2_asym": IntxWeightOnlyConfig(
            weight_dtype=torch.int2, granularity=PerGroup(16), mapping_type=MappingType.ASYMMETRIC
        ),
    }
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(48, 24)).to(dtype)
    quantize_(model, configs[kind])
    state = model.state_dict()
    reference = state["0.weight"].dequantize()
    torch.save(state, tmp_path / "model.pt")
    data, metadata = flatten_tensor_state_dict(state)
    save_file({k: v.contiguous() for k, v in data.items()}, tmp_path / "model.safetensors", metadata=metadata)
    for fixture in ("model.pt", "model.safetensors"):
        out = decode_all(tmp_path / fixture)["0.weight"]
        assert out.dtype == reference.dtype
        assert torch.equal(float_bits(out), float_bits(reference)), fixture
        scheme = {w.name: w.scheme for w in qtool.inspect(tmp_path / fixture).weights}["0.weight"]
        assert scheme.symmetric == (kind != "intx2_asym"), (fixture, scheme.label)  # intx4: all zero points 0


def test_intx_with_a_nonzero_zero_point_is_asymmetric(tmp_path):
    """IntxUnpackedToInt8Tensor always stores zero points: their values say the grid, not their presence."""
    data = load_file(FIXTURES / "model.safetensors")
    with open(FIXTURES / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    zero = next(k for k in data if k.startswith("intx4.") and k.endswith("zero_point"))
    assert not data[zero].any()
    data[zero].view(-1)[0] = 1
    save_file(data, tmp_path / "model.safetensors", metadata=header["__metadata__"])
    found = {w.name: w for w in qtool.inspect(tmp_path / "model.safetensors").weights}
    assert found["intx4.weight"].scheme.label == "int4 asym g32"


def test_without_torchao_the_pickle_reads_and_imports_nothing(tmp_path):
    """A torchao pickle, read where torchao cannot be imported: qtool's own table of torchao's
    classes says what each name is, so torchao is not needed, and neither is torch."""
    blocker = tmp_path / "site" / "torchao"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('No module named torchao')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)])}
    env.pop("QTOOL_DEBUG", None)
    code = "import sys, json, qtool\nprint(json.dumps({w.name: w.scheme.label for w in qtool.inspect(sys.argv[1]).weights if w.scheme}), 'torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code, str(FIXTURES / "model.pt")], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    labels, torch_imported = done.stdout.rsplit(" ", 1)
    assert json.loads(labels) == {name: label for name, (label, _, _) in EXPECTED.items()}
    assert torch_imported.strip() == "False"


# -- ambiguity ------------------------------------------------------------------------------------


def test_qdata_without_torchao_metadata_stays_plain(make_safetensors):
    path = make_safetensors({"0._weight_qdata": ("I8", [4, 8]), "0._weight_scale": ("F32", [4, 1])})
    found = {w.name: w for w in qtool.inspect(path).weights}
    assert all(w.scheme is None for w in found.values())


def test_a_block_size_the_scale_contradicts_is_read_as_the_scale_shows(tmp_path):
    info = {
        "_type": "Int8Tensor",
        "_data": {"block_size": [1, 8], "dtype": {"_type": "torch.dtype", "_data": "float32"}},
        "_tensor_data_names": ["qdata", "scale"],
    }
    path = write_safetensors(
        tmp_path / "model.safetensors",
        {"0._weight_qdata": ("I8", [4, 8]), "0._weight_scale": ("F32", [4, 2])},
        metadata={"tensor_names": json.dumps(["0.weight"]), "0.weight": json.dumps(info)},
    )
    weight = next(w for w in qtool.inspect(path).weights if w.name == "0.weight")
    assert weight.scheme.label == "int8 sym g4"
    assert weight.notes == ["block_size says [1, 8], the scale [4, 2] shows [1, 4]: read as the scale shows"]


def test_a_scale_that_fits_nothing_leaves_the_tensors_plain(tmp_path):
    info = {"_type": "Int8Tensor", "_data": {"block_size": [1, 8]}, "_tensor_data_names": ["qdata", "scale"]}
    path = write_safetensors(
        tmp_path / "model.safetensors",
        {"0._weight_qdata": ("I8", [4, 8]), "0._weight_scale": ("F32", [3, 5])},
        metadata={"tensor_names": json.dumps(["0.weight"]), "0.weight": json.dumps(info)},
    )
    found = qtool.inspect(path).weights
    assert all(w.scheme is None for w in found)
    assert "looks like a torchao Int8Tensor" in found[0].notes[0]


def test_an_unsupported_torchao_type_stays_plain_with_a_note(tmp_path):
    info = {"_type": "NVFP4Tensor", "_data": {}, "_tensor_data_names": ["qdata", "scale"]}
    path = write_safetensors(
        tmp_path / "model.safetensors",
        {"0._weight_qdata": ("U8", [4, 4]), "0._weight_scale": ("F8_E4M3", [4, 1])},
        metadata={"tensor_names": json.dumps(["0.weight"]), "0.weight": json.dumps(info)},
    )
    found = qtool.inspect(path).weights
    assert all(w.scheme is None for w in found)
    assert found[0].notes == ["torchao NVFP4Tensor (0.weight): qtool does not decode this layout yet; left plain"]


@pytest.mark.parametrize("fixture", CONTAINERS)
def test_dequantize_writes_torchaos_values(tmp_path, fixture):
    qtool.dequantize(FIXTURES / fixture, tmp_path / "out.safetensors")
    out = load_file(tmp_path / "out.safetensors")
    expected = load_file(REFERENCE)
    for name in EXPECTED:
        assert out[name].dtype == torch.bfloat16
        assert torch.equal(float_bits(out[name]), float_bits(expected[name])), name
    assert {"int8.bias", "fp8.bias", "intx4.bias"} <= set(out)
    assert not any(name.endswith(("qdata", "scale", "zero_point")) for name in out)


# -- hostile torchao pickles ----------------------------------------------------------------------
# The fixture's pickle with one global rewritten, as a fuzzer's bit flip or a hostile author would:
# qtool refuses each from its own table of torchao's classes, importing neither torch nor torchao
# (importing them to look a name up cost 12+ s of torch._dynamo on a loaded machine).

_INT8 = b"ctorchao.quantization\nInt8Tensor\n"
HOSTILE_GLOBALS = {
    "flipped-class": (b"ctorchao.quantization\nInt8Tensoq\n", "torchao.quantization.Int8Tensoq"),
    "unknown-module": (b"ctorchao.quantizatioo\nInt8Tensor\n", "torchao.quantizatioo.Int8Tensor"),
    "torchao-function": (b"ctorchao.quantization\nquantize_\n", "torchao.quantization.quantize_"),
    "torchao-base": (b"ctorchao\nutils\n", "torchao.utils"),
    "not-torchao": (b"cposix\nsystem\n", "posix.system"),
}


def hostile_torchao_pickle(path: Path, replacement: bytes) -> Path:
    """tests/fixtures/torchao/model.pt with its Int8Tensor global replaced (the zip rewritten, CRCs right)."""
    import zipfile

    with zipfile.ZipFile(FIXTURES / "model.pt") as source, zipfile.ZipFile(path, "w") as out:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("data.pkl"):
                assert data.count(_INT8) == 1
                data = data.replace(_INT8, replacement)
            out.writestr(info, data)
    return path


# Runs `qtool` as `python -m qtool` does; at exit, prints which of torch and torchao were imported
# and how long the command took after qtool's own import.
_REFUSE_AND_REPORT = (
    "import atexit, sys, time\n"
    "from qtool.cli import main\n"
    "start = time.perf_counter()\n"
    "atexit.register(lambda: print('torch' in sys.modules, 'torchao' in sys.modules, round(time.perf_counter() - start, 3)))\n"
    "sys.argv = ['qtool', 'inspect', sys.argv[1]]\n"
    "main()\n"
)


@pytest.mark.parametrize("case", list(HOSTILE_GLOBALS))
def test_a_hostile_torchao_pickle_is_refused_without_importing_torch(tmp_path, case):
    replacement, named = HOSTILE_GLOBALS[case]
    path = hostile_torchao_pickle(tmp_path / "model.pt", replacement)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("QTOOL_DEBUG", None)
    done = subprocess.run(
        [sys.executable, "-c", _REFUSE_AND_REPORT, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert (
        lines[0]
        == f"error: {path}: refused: the pickle calls {named}, which is not tensor data; qtool never runs code from a checkpoint"
    ), lines
    assert all(line.startswith("hint:") for line in lines[1:]), lines
    torch_imported, torchao_imported, seconds = done.stdout.split()
    assert (torch_imported, torchao_imported) == ("False", "False"), "refusing the pickle imported torch or torchao"
    assert float(seconds) < 2.0, f"the refusal took {seconds} s"


def test_python_m_qtool_refuses_a_hostile_torchao_pickle_in_one_line(tmp_path):
    path = hostile_torchao_pickle(tmp_path / "model.pt", HOSTILE_GLOBALS["flipped-class"][0])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("QTOOL_DEBUG", None)
    done = subprocess.run(
        [sys.executable, "-m", "qtool", "inspect", str(path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if not line.startswith("hint:")]
    assert errors == [
        f"error: {path}: refused: the pickle calls torchao.quantization.Int8Tensoq, which is not tensor data; qtool never runs code from a checkpoint"
    ]


# -- the table of torchao's classes ----------------------------------------------------------------


@needs_torchao
def test_the_torchao_table_matches_the_installed_torchao():
    """Every row names a class torchao has, of the kind the row says (each enum's members as
    torchao's); every tensor subclass `torchao.quantization` exports is a row."""
    import dataclasses
    import enum
    import importlib
    import logging
    import warnings

    from qtool.formats.torchao_classes import DATA, ENUM, TENSOR, TORCHAO_CLASSES

    logging.getLogger("torchao").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantization = importlib.import_module("torchao.quantization")
        for (module, name), row in TORCHAO_CLASSES.items():
            cls = getattr(importlib.import_module(module), name)
            assert isinstance(cls, type) and (cls.__module__, cls.__qualname__) == (module, name), (module, name)
            if row.kind == TENSOR:
                assert issubclass(cls, torch.Tensor), name
            elif row.kind == ENUM:
                assert issubclass(cls, enum.Enum) and dict(row.members) == {m.value: m.name for m in cls}, name
            else:
                assert row.kind == DATA and (dataclasses.is_dataclass(cls) or issubclass(cls, tuple)), name
    exported = {
        (value.__module__, value.__qualname__)
        for value in vars(quantization).values()
        if isinstance(value, type)
        and issubclass(value, torch.Tensor)
        and value.__module__.startswith("torchao")
        and value.__name__ != "TorchAOBaseTensor"
    }
    assert exported <= {key for key, row in TORCHAO_CLASSES.items() if row.kind == TENSOR}, exported


def test_every_type_the_convention_decodes_is_in_the_table():
    from qtool.conventions.torchao import SUPPORTED
    from qtool.formats.torchao_classes import TENSOR, TORCHAO_CLASSES

    tensors = {name for (_, name), row in TORCHAO_CLASSES.items() if row.kind == TENSOR}
    assert set(SUPPORTED) <= tensors


def test_an_enum_value_torchao_does_not_have_is_a_malformed_pickle(tmp_path):
    """KernelPreference('auto') rewritten to a value no member has: one line, as Enum(value) would fail."""
    import zipfile

    path = tmp_path / "model.pt"
    with zipfile.ZipFile(FIXTURES / "model.pt") as source, zipfile.ZipFile(path, "w") as out:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("data.pkl"):
                assert b"X\x04\x00\x00\x00auto" in data
                data = data.replace(b"X\x04\x00\x00\x00auto", b"X\x04\x00\x00\x00autx")
            out.writestr(info, data)
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 2, result.output
    assert (
        result.stderr.splitlines()[0]
        == f"error: {path}: has a malformed pickle: torchao.quantization.quantize_.common.kernel_preference.KernelPreference has no member 'autx'"
    )
