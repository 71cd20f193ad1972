"""The compressed-tensors codec: decode, encode, encoded_layout and config_for.

Proofs, in order:
(a) `decode` of every fixture written by the real compressed-tensors 0.20.1 equals the
    package's own decompressed reference, bit for bit.
(b) `encode` writes exactly the tensors `encoded_layout` promises (names, dtypes, shapes).
(c) With the package installed: qtool's `encode` equals the package's own compression of the
    same weights (min-max calibration through its `calculate_qparams` / `generate_gparam`,
    then `compress_model`) byte for byte -- no rounding differs, in bfloat16 and float16, so
    the bound is zero steps. The one intended difference: the FP8 preset calibrates a static
    `input_scale`, and qtool, which sees no activations, writes dynamic per-token activations.
(d) The package loads what qtool wrote (config through `QuantizationConfig.model_validate`,
    tensors through `apply_quantization_config` + `ModelCompressor.decompress_model`) and its
    decompressed weights equal qtool's `decode` bit for bit.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import pytest
import torch

import qtool
from qtool.conventions import compressed_tensors as ct
from qtool.conventions import resolve
from qtool.errors import UsageError
from qtool.layouts import compressed_tensors as ct_encode
from qtool.qtypes import qtype
from qtool.scheme import QScheme
from tests.conftest import CT_FIXTURES

FIXTURES = sorted(p.name for p in CT_FIXTURES.iterdir() if (p / "reference").is_dir())


def _scheme(name: str, block, **kwargs) -> QScheme:
    kwargs.setdefault("scale_dtype", "auto")
    return QScheme(qtype(name), block, **kwargs)


SCHEMES = {
    "W8A16": _scheme("int8", (1, 128)),
    "W4A16": _scheme("int4", (1, 128)),
    "W4A16_ASYM": _scheme("int4", (1, 128), symmetric=False, zero_point=True),
    "int2_g64": _scheme("int2", (1, 64)),
    "int8_channel": _scheme("int8", (1, None)),
    "int4_asym_channel": _scheme("int4", (1, None), symmetric=False, zero_point=True),
    "int4_asym_tensor": _scheme("int4", (None, None), symmetric=False, zero_point=True),
    "int3_asym_g32": _scheme("int3", (1, 32), symmetric=False, zero_point=True),
    "FP8": _scheme("fp8_e4m3", (None, None)),
    "FP8_DYNAMIC": _scheme("fp8_e4m3", (1, None)),
    "FP8_BLOCK": _scheme("fp8_e4m3", (128, 128)),
    "NVFP4A16": _scheme("fp4_e2m1", (1, 16), scale_dtype="E4M3", global_scale=True),
    "MXFP4A16": _scheme("fp4_e2m1", (1, 32), scale_dtype="E8M0"),
    "MXFP8A16": _scheme("fp8_e4m3", (1, 32), scale_dtype="E8M0"),
}
# shapes with odd sizes where the layout allows them
SHAPES = {
    "int8_channel": (20, 100),
    "int4_asym_channel": (20, 100),  # zero points: 20 rows pack into 3 int32 rows
    "int4_asym_tensor": (9, 40),  # per-tensor zero point stays unpacked int8
    "FP8": (10, 30),
    "FP8_DYNAMIC": (10, 30),
    "FP8_BLOCK": (200, 300),  # partial edge blocks
    "W4A16_ASYM": (12, 256),
}
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _weight(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=generator) * 0.05 * (1 + 3 * torch.rand(shape[0], 1, generator=generator))
    w[0, : min(64, shape[1])] = 0.0  # all-zero groups: the zero-scale paths
    return w.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


# -- (a) fixtures -----------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", FIXTURES)
def test_decode_equals_the_packages_reference_bit_for_bit(fixture):
    from safetensors.torch import load_file

    reference = load_file(CT_FIXTURES / fixture / "reference" / "weights.safetensors")
    checkpoint = qtool.open_checkpoint(CT_FIXTURES / fixture / "model.safetensors")
    weights = {w.name: w for w in resolve(checkpoint)}
    assert set(reference) <= set(weights)
    for name, expected in reference.items():
        out = ct.decode(checkpoint, weights[name], "cpu")
        assert out.dtype == expected.dtype and out.shape == expected.shape, name
        assert torch.equal(_bits(out), _bits(expected)), f"{fixture} {name}: {(out != expected).sum()} values differ"


# -- (b) encode vs encoded_layout -------------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_encode_writes_exactly_the_encoded_layout(name, dtype):
    shape = SHAPES.get(name, (16, 256))
    layout = ct_encode.encoded_layout("model.layers.0.mlp.up_proj.weight", shape, dtype, SCHEMES[name])
    out = ct_encode.encode("model.layers.0.mlp.up_proj.weight", _weight(shape, DTYPES[dtype]), SCHEMES[name])
    from qtool.dtypes import DTYPES as STORAGE

    by_torch = {d.torch_name: d.name for d in STORAGE.values() if d.torch_name}
    written = [(key, by_torch[str(t.dtype).removeprefix("torch.")], tuple(t.shape)) for key, t in out.items()]
    assert written == layout
    assert all(t.is_contiguous() for t in out.values())


def test_layout_of_the_usual_presets():
    w = "model.layers.0.mlp.down_proj.weight"
    m = "model.layers.0.mlp.down_proj"
    assert ct_encode.encoded_layout(w, (12, 256), "BF16", SCHEMES["W4A16_ASYM"]) == [
        (f"{m}.weight_packed", "I32", (12, 32)),
        (f"{m}.weight_scale", "BF16", (12, 2)),
        (f"{m}.weight_zero_point", "I32", (2, 2)),
        (f"{m}.weight_shape", "I64", (2,)),
    ]
    assert ct_encode.encoded_layout(w, (200, 300), "F16", SCHEMES["FP8_BLOCK"]) == [
        (f"{m}.weight", "F8_E4M3", (200, 300)),
        (f"{m}.weight_scale", "F16", (2, 3)),
    ]
    assert ct_encode.encoded_layout(w, (12, 256), "BF16", SCHEMES["NVFP4A16"]) == [
        (f"{m}.weight_packed", "U8", (12, 128)),
        (f"{m}.weight_scale", "F8_E4M3", (12, 16)),
        (f"{m}.weight_global_scale", "F32", (1,)),
    ]
    assert ct_encode.encoded_layout(w, (12, 256), "BF16", SCHEMES["MXFP4A16"])[1] == (
        f"{m}.weight_scale",
        "U8",
        (12, 8),
    )
    # an explicit scale dtype is honoured; "auto" follows the weight, as compressed-tensors does
    f32_scales = QScheme(qtype("int4"), (1, 128), scale_dtype="F32")
    assert ct_encode.encoded_layout(w, (12, 256), "BF16", f32_scales)[1] == (f"{m}.weight_scale", "F32", (12, 2))


def test_ragged_groups_are_refused_naming_both_numbers():
    with pytest.raises(UsageError) as error:
        ct_encode.encoded_layout("m.proj.weight", (16, 200), "BF16", SCHEMES["W4A16"])
    assert (
        error.value.message
        == "compressed-tensors refuses group size 128 for m.proj.weight: in_features 200 is not a multiple of 128"
    )
    assert error.value.hint == "use a group size that divides 200 (e.g. 8), or leave this weight unquantized"
    with pytest.raises(UsageError, match="group size 16 for m.proj.weight: in_features 40 is not a multiple of 16"):
        ct_encode.encode("m.proj.weight", torch.zeros(16, 40), SCHEMES["NVFP4A16"])


@pytest.mark.parametrize(
    "scheme, message",
    [
        (QScheme(qtype("nf4"), (1, 64)), "compressed-tensors has no layout for nf4 g64 with F32 scales"),
        (QScheme(qtype("uint4"), (1, 128), symmetric=False), "compressed-tensors stores signed ints: use int4"),
        (QScheme(qtype("fp8_e5m2"), (1, None)), "compressed-tensors has no layout for fp8_e5m2 channel"),
        (QScheme(qtype("fp4_e2m1"), (1, 32), scale_dtype="E4M3"), "compressed-tensors has no layout for nvfp4 g32"),
    ],
    ids=["nf4", "uint4", "e5m2", "nvfp4-g32"],  # an asymmetric fp8 scheme cannot even be built
)
def test_schemes_compressed_tensors_cannot_store(scheme, message):
    with pytest.raises(UsageError, match=message):
        ct_encode.encoded_layout("m.proj.weight", (16, 256), "BF16", scheme)


def test_encode_keeps_the_device_and_never_touches_its_input():
    w = _weight((16, 256), torch.bfloat16)
    before = w.clone()
    out = ct_encode.encode("m.proj.weight", w, SCHEMES["W4A16_ASYM"])
    assert torch.equal(w, before) and all(t.device == w.device for t in out.values())


# -- config_for ---------------------------------------------------------------------------------


def test_config_for_one_scheme_and_a_mix():
    config = ct_encode.config_for(
        {"model.layers.1.mlp.up_proj": SCHEMES["W4A16"], "model.layers.0.mlp.up_proj": SCHEMES["W4A16"]},
        ["lm_head"],
        "BF16",
    )
    assert config["format"] == "pack-quantized" and config["quantization_status"] == "compressed"
    assert config["config_groups"]["group_0"]["targets"] == ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]
    assert config["config_groups"]["group_0"]["weights"] == {
        "num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "strategy": "group", "dynamic": False,
    }  # fmt: skip
    mixed = ct_encode.config_for(
        {"a.q_proj": SCHEMES["W4A16"], "a.down_proj": SCHEMES["FP8_BLOCK"], "a.up_proj": SCHEMES["NVFP4A16"]}, []
    )
    assert mixed["format"] == "mixed-precision"
    assert [g["format"] for g in mixed["config_groups"].values()] == [
        "pack-quantized",
        "float-quantized",
        "nvfp4-pack-quantized",
    ]
    assert mixed["config_groups"]["group_1"]["input_activations"] == {
        "num_bits": 8, "type": "float", "symmetric": True, "group_size": 128, "strategy": "group", "dynamic": True,
    }  # fmt: skip
    with pytest.raises(UsageError, match="no quantized modules"):
        ct_encode.config_for({}, [])


# -- (c) and (d): against the real package ----------------------------------------------------

PRESETS = {  # qtool scheme -> the package's preset (or custom weight args)
    "W8A16": "W8A16",
    "W4A16": "W4A16",
    "W4A16_ASYM": "W4A16_ASYM",
    "int2_g64": {"num_bits": 2, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True},
    "int8_channel": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
    "int4_asym_channel": {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": False},
    "int4_asym_tensor": {"num_bits": 4, "type": "int", "strategy": "tensor", "symmetric": False},
    "int3_asym_g32": {"num_bits": 3, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False},
    "FP8": "FP8",
    "FP8_DYNAMIC": "FP8_DYNAMIC",
    "FP8_BLOCK": "FP8_BLOCK",
    "NVFP4A16": "NVFP4A16",
    "MXFP4A16": "MXFP4A16",
    "MXFP8A16": "MXFP8A16",
}
MODULES = ("q_proj", "down_proj")


@pytest.fixture(scope="module")
def package():
    pytest.importorskip("compressed_tensors")
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        from loguru import logger

        logger.remove()
    except ImportError:  # pragma: no cover
        pass
    import compressed_tensors

    assert compressed_tensors.__version__.startswith("0.20"), compressed_tensors.__version__
    return compressed_tensors


def _shapes(name):
    return {"q_proj": (256, 256), "down_proj": SHAPES.get(name, (96, 384))}


def _model(shapes, dtype):
    from torch import nn

    model = nn.Module()
    for module, (rows, cols) in shapes.items():
        setattr(model, module, nn.Linear(cols, rows, bias=False))
    return model.to(dtype)


def _package_scheme(name):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    preset = PRESETS[name]
    if isinstance(preset, str):
        return preset_name_to_scheme(preset, targets=["Linear"])
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(dynamic=False, **preset))


def _minmax(x, args):
    strategy = args.strategy
    if strategy == "tensor":
        return x.amin(), x.amax()
    if strategy == "channel":
        return x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    if strategy in ("group", "tensor_group"):
        groups = x.unflatten(-1, (-1, args.group_size))
        return groups.amin(dim=-1), groups.amax(dim=-1)
    rows, cols = args.block_structure
    padded = torch.nn.functional.pad(x, (0, (-x.shape[1]) % cols, 0, (-x.shape[0]) % rows))
    blocks = padded.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols))
    return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))


def _package_compress(name, weights):
    """The package's own pipeline: min-max through its calculate_qparams, then compress_model
    (what llm-compressor's observers and save do; tests/fixtures/make_ct_fixtures.py too)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    model = _model({m: tuple(w.shape) for m, w in weights.items()}, next(iter(weights.values())).dtype)
    config = QuantizationConfig(
        config_groups={"group_0": _package_scheme(name)}, quantization_status=QuantizationStatus.INITIALIZED
    )
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module_name, w in weights.items():
            module = getattr(model, module_name)
            module.weight.copy_(w)
            args = module.quantization_scheme.weights
            global_scale = None
            if args.strategy == "tensor_group":
                global_scale = generate_gparam(w.amin(), w.amax())
                module.weight_global_scale.data.copy_(global_scale)
            scale, zero_point = calculate_qparams(*_minmax(w, args), args, global_scale=global_scale)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero_point.to(module.weight_zero_point.dtype).reshape(
                    module.weight_zero_point.shape
                )
            if hasattr(module, "input_scale"):  # the FP8 preset's static activations: any value
                module.input_scale.data.fill_(1.0)
            module.quantization_status = QuantizationStatus.FROZEN
    ModelCompressor.from_pretrained_model(model).compress_model(model)
    return {k: v.detach() for k, v in model.state_dict().items()}


# float16 where it takes other paths: MX scales (the package's float16 underflow, mirrored),
# NVFP4's global scale, asymmetric zero points, padded blocks
F16_TOO = ("MXFP4A16", "MXFP8A16", "NVFP4A16", "W4A16_ASYM", "FP8_BLOCK")


@pytest.mark.parametrize(
    "name, dtype",
    [(name, "BF16") for name in sorted(PRESETS)] + [(name, "F16") for name in F16_TOO],
    ids=lambda v: str(v),
)
def test_encode_equals_the_packages_compression(package, name, dtype):
    weights = {m: _weight(s, DTYPES[dtype], seed=i) for i, (m, s) in enumerate(_shapes(name).items())}
    expected = _package_compress(name, weights)
    ours = {}
    for module, w in weights.items():
        ours.update(ct_encode.encode(f"{module}.weight", w, SCHEMES[name]))
    intended = {f"{m}.input_scale" for m in weights} if name == "FP8" else set()
    assert set(expected) - set(ours) == intended and set(ours) <= set(expected)
    for key, tensor in ours.items():
        reference = expected[key]
        assert (tensor.dtype, tuple(tensor.shape)) == (reference.dtype, tuple(reference.shape)), key
        assert torch.equal(_bits(tensor), _bits(reference)), (
            f"{key}: {(_bits(tensor) != _bits(reference)).sum()} bytes differ"
        )


def _write(tmp_path, tensors, config):
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"}
    )
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}, indent=2))


def _package_decompress(path, shapes, dtype):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file

    config = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    model = _model(shapes, dtype)
    apply_quantization_config(model, config, show_progress=False)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(model)  # creates the compressed parameters with the file's shapes
    model.load_state_dict(load_file(path / "model.safetensors"), strict=True)
    with contextlib.redirect_stderr(io.StringIO()):
        compressor.decompress_model(model)
    return {f"{m}.weight": getattr(model, m).weight.detach() for m in shapes}


@pytest.mark.parametrize(
    "name",
    [
        "W8A16",
        "W4A16",
        "W4A16_ASYM",
        "int3_asym_g32",
        "int4_asym_channel",
        "FP8",
        "FP8_BLOCK",
        "NVFP4A16",
        "MXFP4A16",
        "MXFP8A16",
    ],
)
def test_the_package_loads_what_qtool_writes_and_decodes_it_as_qtool_does(package, tmp_path, name):
    shapes = _shapes(name)
    tensors = {}
    for i, (module, shape) in enumerate(shapes.items()):
        tensors.update(ct_encode.encode(f"{module}.weight", _weight(shape, torch.bfloat16, seed=i), SCHEMES[name]))
    _write(tmp_path, tensors, ct_encode.config_for({m: SCHEMES[name] for m in shapes}, [], "BF16"))
    expected = _package_decompress(tmp_path, shapes, torch.bfloat16)
    checkpoint = qtool.open_checkpoint(tmp_path)
    weights = {w.name: w for w in resolve(checkpoint)}
    for key, reference in expected.items():
        assert weights[key].notes == [] and weights[key].convention == "compressed-tensors"
        out = ct.decode(checkpoint, weights[key], "cpu")
        assert out.dtype == reference.dtype == torch.bfloat16
        assert torch.equal(_bits(out), _bits(reference)), key


def test_qtools_config_is_the_packages_own(package):
    """config_for == what ModelCompressor writes for the same preset (FP8: activations differ
    by design), and the package validates every config qtool writes, a mixed one included."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    modules = ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"]
    for name in ("W8A16", "W4A16", "W4A16_ASYM", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16", "MXFP8A16"):
        ours = ct_encode.config_for({m: SCHEMES[name] for m in modules}, ["lm_head"], "BF16")
        scheme = _package_scheme(name)
        scheme.targets = modules
        scheme.format = ours["config_groups"]["group_0"]["format"]
        reference = QuantizationConfig(
            config_groups={"group_0": scheme}, ignore=["lm_head"], format=scheme.format,
            quantization_status=QuantizationStatus.COMPRESSED,
        )  # fmt: skip
        theirs = {
            "version": package.__version__,
            "quant_method": "compressed-tensors",
            "sparsity_config": {},
            "transform_config": {},
        }
        theirs.update(json.loads(json.dumps(reference.model_dump(exclude=["quant_method"]))))
        if name == "FP8":  # static per-tensor input scales need calibration; qtool writes dynamic per-token
            assert theirs["config_groups"]["group_0"].pop("input_activations")["dynamic"] is False
            assert ours["config_groups"]["group_0"].pop("input_activations")["strategy"] == "token"
        assert ours == theirs, name
        QuantizationConfig.model_validate(ours)
    mixed = ct_encode.config_for(
        {"a.q_proj": SCHEMES["W4A16_ASYM"], "a.down_proj": SCHEMES["FP8_BLOCK"], "a.up_proj": SCHEMES["MXFP4A16"]},
        ["lm_head"],
    )
    validated = QuantizationConfig.model_validate(mixed)
    assert validated.format == "mixed-precision" and len(validated.config_groups) == 3


def test_the_packages_mxfp6_decodes_bit_for_bit(package, tmp_path):
    """qtool writes no mxfp6, but reads the package's."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    shapes = {"q_proj": (16, 128), "down_proj": (12, 256)}
    model = _model(shapes, torch.bfloat16)
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("MXFP6A16", ["Linear"])}, quantization_status="initialized"
    )
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for i, module_name in enumerate(shapes):
            module = getattr(model, module_name)
            module.weight.copy_(_weight(shapes[module_name], torch.bfloat16, seed=i))
            scale, _ = calculate_qparams(
                *_minmax(module.weight, module.quantization_scheme.weights), module.quantization_scheme.weights
            )
            module.weight_scale.data = scale.to(torch.bfloat16)
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    _write(
        tmp_path,
        model.state_dict(),
        json.loads(
            json.dumps(
                compressor.quantization_config.model_dump(exclude=["quant_method"])
                | {"quant_method": "compressed-tensors"}
            )
        ),
    )
    expected = _package_decompress(tmp_path, shapes, torch.bfloat16)
    checkpoint = qtool.open_checkpoint(tmp_path)
    weights = {w.name: w for w in resolve(checkpoint)}
    for key, reference in expected.items():
        assert weights[key].scheme.qtype.name == "fp6_e2m3"
        assert torch.equal(_bits(ct.decode(checkpoint, weights[key], "cpu")), _bits(reference)), key


# -- fp8 checkpoints outside compressed-tensors (qtool.conventions.fp8.decode) ----------------
# The same float8 math under DeepSeek's and vLLM's names, checked against values computed
# element by element here.


def _fp8_bytes(values: torch.Tensor) -> bytes:
    return values.contiguous().view(torch.uint8).numpy().tobytes()


def test_fp8_deepseek_block_scales_multiply_with_edge_blocks(make_safetensors):
    from qtool.conventions import fp8

    rows, cols = 200, 300
    grid = torch.arange(rows * cols).reshape(rows, cols)
    values = ((grid * 7 % 17) - 8).float() * 0.5  # exact in e4m3
    scale_inv = torch.tensor([[0.5, 2.0, 0.25], [4.0, 1.0, 8.0]])  # [ceil(200/128), ceil(300/128)]
    path = make_safetensors(
        {"l.weight": ("F8_E4M3", [rows, cols]), "l.weight_scale_inv": ("F32", [2, 3])},
        data={"l.weight": _fp8_bytes(values.to(torch.float8_e4m3fn)), "l.weight_scale_inv": _fp8_bytes(scale_inv)},
    )
    (path.parent / "config.json").write_text(
        json.dumps(
            {"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
        )
    )
    checkpoint = qtool.open_checkpoint(path)
    [weight] = resolve(checkpoint)
    out = fp8.decode(checkpoint, weight)
    expected = values.clone()
    for i in range(2):  # block by block, edge blocks [128:200] and [256:300] included
        for j in range(3):
            expected[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= float(scale_inv[i, j])
    assert out.dtype == torch.bfloat16 and out.shape == (rows, cols)
    assert torch.equal(out, expected.to(torch.bfloat16))
    assert out[199, 299].item() == float(values[199, 299]) * 8.0  # the corner of the partial edge block


@pytest.mark.parametrize("scale_shape", [[], [1], [6], [6, 1]], ids=["scalar", "tensor", "channel", "channel-2d"])
def test_fp8_per_tensor_and_per_channel_weight_scale(make_safetensors, scale_shape):
    from qtool.conventions import fp8

    values = torch.tensor([[1.0, -2.0, 0.5, 448.0]] * 6)
    scales = torch.tensor([0.5, 0.25, 2.0, 1.5, 3.0, 0.125])[: math.prod(scale_shape) if scale_shape else 1]
    path = make_safetensors(
        {"l.weight": ("F8_E5M2", [6, 4]), "l.weight_scale": ("F32", scale_shape), "l.input_scale": ("F32", [])},
        data={
            "l.weight": _fp8_bytes(values.to(torch.float8_e5m2)),
            "l.weight_scale": _fp8_bytes(scales),
            "l.input_scale": _fp8_bytes(torch.ones(1)),
        },
    )
    checkpoint = qtool.open_checkpoint(path)
    [weight] = resolve(checkpoint)
    out = fp8.decode(checkpoint, weight)
    row_scale = [float(scales[i if len(scales) > 1 else 0]) for i in range(6)]
    expected = torch.tensor([[v * row_scale[i] for v in (1.0, -2.0, 0.5, 448.0)] for i in range(6)])
    assert out.dtype == torch.float32 and torch.equal(out, expected)  # no torch_dtype: float32


def test_row_chunked_decode_is_identical_to_whole_weights(monkeypatch):
    """decode bounds its float temporaries by decoding in row chunks; the bytes must not change."""
    import qtool
    import qtool.conventions.compressed_tensors as ct
    from qtool.conventions import decoder_for
    from tests.conftest import CT_FIXTURES

    checked = 0
    for fixture in sorted(p for p in CT_FIXTURES.iterdir() if p.is_dir()):
        report = qtool.inspect(fixture)
        for weight in (w for w in report.weights if w.quantized):
            monkeypatch.setattr(ct, "_DECODE_CHUNK", 1 << 30)
            whole = decoder_for(weight).decode(report.checkpoint, weight, "cpu")
            monkeypatch.setattr(ct, "_DECODE_CHUNK", 1)  # the smallest chunk: one block row at a time
            chunked = decoder_for(weight).decode(report.checkpoint, weight, "cpu")
            assert torch.equal(whole, chunked), (fixture.name, weight.name)
            checked += 1
    assert checked >= 28
