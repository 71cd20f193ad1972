"""bitsandbytes 4-bit: encode / encoded_layout / config_for, detect and decode.

By hand: a tiny layout written byte by byte decodes to values computed from the codebook.
Against bitsandbytes 0.50 where it is installed: qtool's encode equals `quantize_4bit` +
`QuantState.as_dict(packed=True)` byte for byte, and `dequantize_4bit` of qtool's output
(nested too) equals qtool's decode bit for bit.
"""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch

import qtool
from qtool import kernels
from qtool.conventions import bitsandbytes as bnb
from qtool.conventions import resolve
from qtool.conventions.plain import Plain
from qtool.errors import UsageError
from qtool.layouts import bitsandbytes as bnb_layout
from qtool.qtypes import qtype
from qtool.scheme import QScheme

REGISTRY = (bnb.Bitsandbytes(), Plain())
NF4 = QScheme(qtype("nf4"), (1, 64))
SCHEMES = {
    "nf4-g64": NF4,
    "nf4-g32": QScheme(qtype("nf4"), (1, 32)),
    "fp4-g64": QScheme(qtype("fp4_bnb"), (1, 64)),
    "nf4-g128": QScheme(qtype("nf4"), (1, 128)),
}
SHAPES = [(64, 256), (33, 65), (7, 3)]  # whole blocks; partial last block and odd numel; tiny
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _weight(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=generator) * 0.02
    w.view(-1)[:70] = 0.0  # an all-zero block
    return w.to(dtype)


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _state(quant_type, blocksize, dtype, shape, **nested):
    return json.dumps(
        {"quant_type": quant_type, "blocksize": blocksize, "dtype": dtype, "shape": list(shape), **nested}
    ).encode()


# -- layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_encode_writes_exactly_the_encoded_layout(scheme, dtype, shape):
    from qtool.dtypes import DTYPES as STORAGE

    by_torch = {d.torch_name: d.name for d in STORAGE.values() if d.torch_name}
    out = bnb_layout.encode("m.up_proj.weight", _weight(shape, DTYPES[dtype]), SCHEMES[scheme])
    written = [(key, by_torch[str(t.dtype).removeprefix("torch.")], tuple(t.shape)) for key, t in out.items()]
    assert written == bnb_layout.encoded_layout("m.up_proj.weight", shape, dtype, SCHEMES[scheme])


def test_layout_by_hand():
    blob = b'{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [33, 65]}'
    assert bnb_layout.encoded_layout("m.w.weight", (33, 65), "BF16", NF4) == [
        ("m.w.weight", "U8", (1073, 1)),  # ceil(2145 / 2)
        ("m.w.weight.absmax", "F32", (34,)),  # ceil(2145 / 64)
        ("m.w.weight.quant_map", "F32", (16,)),
        ("m.w.weight.quant_state.bitsandbytes__nf4", "U8", (len(blob),)),
    ]
    out = bnb_layout.encode("m.w.weight", _weight((33, 65), torch.bfloat16), NF4)
    assert bytes(out["m.w.weight.quant_state.bitsandbytes__nf4"].tolist()) == blob


@pytest.mark.parametrize(
    "scheme, message",
    [
        (QScheme(qtype("nf4"), (1, None)), "bitsandbytes quantizes in blocks \\(nf4:g64\\), not per channel"),
        (
            QScheme(qtype("nf4"), (1, 16)),
            "bitsandbytes blocksize must be one of \\[32, 64, 128, 256, 512, 1024, 2048, 4096\\], not 16",
        ),
        (QScheme(qtype("int4"), (1, 64)), "bitsandbytes 4-bit stores nf4 or fp4_bnb, not int4"),
        (QScheme(qtype("nf4"), (1, 64), scale_dtype="BF16"), "bitsandbytes stores float32 absmax scales, not BF16"),
    ],
    ids=["channel", "blocksize", "int4", "scale-dtype"],
)
def test_what_bitsandbytes_cannot_store(scheme, message):
    with pytest.raises(UsageError, match=message):
        bnb_layout.encoded_layout("m.weight", (8, 64), "BF16", scheme)


def test_config_for():
    config = bnb_layout.config_for({"m.up_proj": NF4, "m.down_proj": SCHEMES["nf4-g32"]}, ["lm_head"], "BF16")
    assert config["bnb_4bit_quant_type"] == "nf4" and config["bnb_4bit_compute_dtype"] == "bfloat16"
    assert config["load_in_4bit"] is True and config["llm_int8_skip_modules"] == ["lm_head"]
    with pytest.raises(UsageError, match="one bitsandbytes config holds one 4-bit type, got fp4 and nf4"):
        bnb_layout.config_for({"a": NF4, "b": SCHEMES["fp4-g64"]}, [], "BF16")


def test_config_for_is_transformers_own():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    ours = bnb_layout.config_for({"m.up_proj": NF4}, ["lm_head"], "BF16")
    theirs = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        llm_int8_skip_modules=["lm_head"],
    ).to_dict()
    assert ours == theirs
    assert transformers.BitsAndBytesConfig.from_dict(ours).to_dict() == theirs


# -- detect and decode ----------------------------------------------------------------------------


def test_a_hand_written_layout_decodes_by_hand(make_safetensors):
    # [2, 3] nf4, one block: codes 15 0 7 | 12 8 3, packed high nibble first
    table = kernels.NF4_CODEBOOK
    path = make_safetensors(
        {
            "m.proj.weight": ("U8", [3, 1]),
            "m.proj.weight.absmax": ("F32", [1]),
            "m.proj.weight.quant_map": ("F32", [16]),
            "m.proj.weight.quant_state.bitsandbytes__nf4": ("U8", [len(_state("nf4", 64, "float16", (2, 3)))]),
        },
        data={
            "m.proj.weight": bytes([0xF0, 0x7C, 0x83]),
            "m.proj.weight.absmax": struct.pack("<f", 2.0),
            "m.proj.weight.quant_map": struct.pack("<16f", *table),
            "m.proj.weight.quant_state.bitsandbytes__nf4": _state("nf4", 64, "float16", (2, 3)),
        },
    )
    checkpoint = qtool.open_checkpoint(path)
    [weight] = resolve(checkpoint, REGISTRY)
    assert (weight.name, weight.shape, weight.dtype, weight.convention) == (
        "m.proj.weight",
        (2, 3),
        "F16",
        "bitsandbytes",
    )
    assert weight.scheme.label == "nf4 g64" and set(weight.members) == {"data", "scale", "quant_map", "quant_state"}
    assert weight.notes == ["blocks of 64 run across rows of 3 (bitsandbytes blocks the flattened weight)"]
    out = bnb.decode(checkpoint, weight)
    expected = torch.tensor([[2.0, -2.0, 0.0], [2 * table[12], 2 * table[8], 2 * table[3]]]).to(torch.float16)
    assert out.dtype == torch.float16 and torch.equal(out, expected)


def test_a_hand_written_nested_layout_decodes_by_hand(make_safetensors):
    # two blocks of 32 (64 values); absmax is double-quantized: absmax_j = map[u8_j] * nested_absmax + offset
    codes = bytes([0xF0] * 32)  # every pair: code 15 (1.0), code 0 (-1.0)
    nested_map = [i / 255 for i in range(256)]
    state = _state("nf4", 32, "bfloat16", (2, 32), nested_blocksize=256, nested_dtype="float32", nested_offset=0.5)
    path = make_safetensors(
        {
            "w": ("U8", [32, 1]),
            "w.absmax": ("U8", [2]),
            "w.quant_map": ("F32", [16]),
            "w.nested_absmax": ("F32", [1]),
            "w.nested_quant_map": ("F32", [256]),
            "w.quant_state.bitsandbytes__nf4": ("U8", [len(state)]),
        },
        data={
            "w": codes,
            "w.absmax": bytes([255, 51]),
            "w.quant_map": struct.pack("<16f", *kernels.NF4_CODEBOOK),
            "w.nested_absmax": struct.pack("<f", 2.0),
            "w.nested_quant_map": struct.pack("<256f", *nested_map),
            "w.quant_state.bitsandbytes__nf4": state,
        },
    )
    checkpoint = qtool.open_checkpoint(path)
    [weight] = resolve(checkpoint, REGISTRY)
    assert dict(weight.provenance.details)["double_quant"] == "yes"
    out = bnb.decode(checkpoint, weight).float()
    first = torch.tensor(1.0) * 2.0 + 0.5  # map[255] = 1.0
    second = torch.tensor(51 / 255, dtype=torch.float32) * 2.0 + 0.5
    assert out[0, 0].item() == first.item() and out[0, 1].item() == -first.item()
    assert out[1, 0].item() == pytest.approx(second.item(), rel=2**-8) and out[1, 1].item() == -out[1, 0].item()


def test_qtools_file_round_trips_within_the_codebook_bound(tmp_path):
    from safetensors.torch import save_file

    w = _weight((33, 65), torch.bfloat16, seed=3)
    save_file(bnb_layout.encode("m.proj.weight", w, NF4), tmp_path / "model.safetensors")
    checkpoint = qtool.open_checkpoint(tmp_path)
    [weight] = resolve(checkpoint, REGISTRY)
    assert weight.shape == (33, 65) and weight.dtype == "BF16" and weight.scheme.bits == 4
    out = bnb.decode(checkpoint, weight)
    absmax = w.float().reshape(-1).abs()
    block_max = torch.nn.functional.pad(absmax, (0, (-absmax.numel()) % 64)).reshape(-1, 64).amax(1)
    # half the widest nf4 gap (-1 to -0.6962), plus the bfloat16 rounding of the output
    bound = block_max.repeat_interleave(64)[: w.numel()].reshape(w.shape) * 0.1520 + out.float().abs() * 2.0**-8
    assert out.dtype == torch.bfloat16 and torch.all((out.float() - w.float()).abs() <= bound)


def test_a_layout_that_does_not_fit_stays_plain_with_a_note(make_safetensors):
    state = _state("nf4", 64, "bfloat16", (8, 64))
    path = make_safetensors(
        {
            "w": ("U8", [256, 1]),
            "w.absmax": ("F32", [3]),  # 512 values in blocks of 64 need 8
            "w.quant_map": ("F32", [16]),
            "w.quant_state.bitsandbytes__nf4": ("U8", [len(state)]),
        },
        data={"w.quant_state.bitsandbytes__nf4": state},
    )
    weights = resolve(qtool.open_checkpoint(path), REGISTRY)
    assert len(weights) == 4 and all(w.scheme is None for w in weights)
    assert all(
        "looks like bitsandbytes 4-bit, but absmax is F32 [3], expected F32 [8]; left plain" in w.notes for w in weights
    )


# -- against bitsandbytes --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def functional():
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as functional

    return functional


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_encode_equals_bitsandbytes(functional, scheme, dtype, shape):
    w = _weight(shape, DTYPES[dtype])
    quant_type = "fp4" if "fp4" in scheme else "nf4"
    packed, state = functional.quantize_4bit(w, blocksize=SCHEMES[scheme].group_size, quant_type=quant_type)
    expected = {"w": packed, **{f"w.{k}": v for k, v in state.as_dict(packed=True).items()}}
    ours = bnb_layout.encode("w", w, SCHEMES[scheme])
    assert list(ours) == ["w", "w.absmax", "w.quant_map", f"w.quant_state.bitsandbytes__{quant_type}"]
    assert set(ours) == set(expected)
    for key, tensor in ours.items():
        assert tensor.dtype == expected[key].dtype and tensor.shape == expected[key].shape, key
        assert torch.equal(_bits(tensor), _bits(expected[key])), key


@pytest.mark.parametrize("scheme", ["nf4-g64", "fp4-g64"])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_bitsandbytes_and_qtool_decode_alike(functional, tmp_path, scheme, nested):
    from bitsandbytes.functional import QuantState
    from safetensors.torch import save_file

    # an even last dim: bitsandbytes' native CPU kernel decodes (an odd one takes its torch
    # fallback, which gives fp4 code 8 as +0.0 where the kernels give -0.0)
    w = _weight((33, 130), torch.bfloat16, seed=5)
    w[5, :64] = 1e-5 * w[5, :64].sign()  # tiny values: fp4 codes 0 and 8 (signed zeros)
    if nested:  # qtool writes no double quantization: bitsandbytes writes it, qtool reads it
        packed, state = functional.quantize_4bit(
            w, blocksize=64, quant_type="fp4" if "fp4" in scheme else "nf4", compress_statistics=True
        )
        tensors = {"m.weight": packed, **{f"m.weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    else:
        tensors = bnb_layout.encode("m.weight", w, SCHEMES[scheme])
        state = QuantState.from_dict(
            {k.removeprefix("m.weight."): v for k, v in tensors.items() if k != "m.weight"}, torch.device("cpu")
        )
    expected = functional.dequantize_4bit(tensors["m.weight"], state)
    save_file(tensors, tmp_path / "model.safetensors")
    checkpoint = qtool.open_checkpoint(tmp_path)
    [weight] = resolve(checkpoint, REGISTRY)
    assert weight.notes == ["blocks of 64 run across rows of 130 (bitsandbytes blocks the flattened weight)"]
    out = bnb.decode(checkpoint, weight)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert torch.equal(_bits(out), _bits(expected))
    assert math.isfinite(out.float().abs().max().item())
