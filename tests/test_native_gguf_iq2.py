"""qtool.native's IQ2_XXS, IQ2_XS and IQ2_S encoders against llama.cpp's quantize_iq2_xxs,
quantize_iq2_xs (importance weights required, as llama.cpp requires them) and quantize_iq2_s
(with or without: llama.cpp's function has both paths, llama-quantize asks for an imatrix), byte
for byte; their decoders against gguf-py's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qtool import native
from qtool.errors import KernelError

from tests.test_native_gguf_iq3 import cases, reference  # noqa: F401  (the compiled llama.cpp fixture, shared)

pytestmark = pytest.mark.skipif(not native.available(), reason="qtool.native._kernels is not built")

FIXTURE = Path(__file__).parent / "fixtures" / "gguf_kquants"
SIZES = {"IQ2_XXS": (66, 256), "IQ2_XS": (74, 512), "IQ2_S": (82, 1024)}  # bytes per super-block, grid points
TYPES = list(SIZES)
REQUIRED = ["IQ2_XXS", "IQ2_XS"]  # no path without weights


def encode(x: np.ndarray, qw: np.ndarray | None, type_name: str = "IQ2_XXS") -> native.EncodedBlocks:
    x = np.ascontiguousarray(x, dtype=np.float32)
    return native.encode_gguf(
        type_name,
        x.tobytes(),
        "F32",
        x.shape[0],
        x.shape[1],
        None if qw is None else np.ascontiguousarray(qw, "<f4").tobytes(),
    )


@pytest.mark.parametrize(
    "type_name, importance", [(t, i) for t in TYPES for i in ["uniform", "activations"]] + [("IQ2_S", None)]
)
def test_every_fixture_row_is_llama_cpp_s_bytes(type_name, importance):
    m = json.loads((FIXTURE / "manifest.json").read_text())
    x = np.fromfile(FIXTURE / "inputs.f32", dtype="<f4").reshape(-1, 256)
    qw = None if importance is None else np.fromfile(FIXTURE / f"importance-{importance}.f32", dtype="<f4")
    file = f"{type_name}.bin" if importance is None else f"{type_name}.imatrix-{importance}.bin"
    size = SIZES[type_name][0]
    aborted = set(m["aborts"].get(file, []))
    assert len(aborted) <= 10
    want, got = (FIXTURE / file).read_bytes(), bytes(encode(x, qw, type_name).data)
    wrong = [
        m["labels"][r]
        for r in range(x.shape[0])
        if m["labels"][r] not in aborted and got[size * r : size * (r + 1)] != want[size * r : size * (r + 1)]
    ]
    assert not wrong


@pytest.mark.parametrize("type_name", REQUIRED)
def test_without_importance_weights_it_is_refused(type_name):
    with pytest.raises(KernelError, match=f"{type_name} needs importance weights"):
        encode(np.zeros((1, 256), np.float32), None, type_name)
    from qtool.native import _kernels

    with pytest.raises(ValueError, match="IQ2_XXS needs importance weights"):
        _kernels.encode_gguf("IQ2_XXS", bytes(1024), 0, 256, bytearray(66), 0, 1)


@pytest.mark.parametrize("type_name", TYPES)
def test_the_grids_are_gguf_py_s(type_name):
    import gguf.quants

    cls, points = getattr(gguf.quants, type_name), SIZES[type_name][1]
    cls.init_grid()
    text = (Path(native.__file__).parent / "src" / "iq2_grids.h").read_text()
    table = text[text.index(f"{type_name.lower().replace('_', '')}_grid[{points}][8] = {{") :]
    table = table[table.index("= {") + 3 : table.index("};")]
    values = [int(v) for v in table.replace("{", " ").replace("}", " ").replace(",", " ").split()]
    assert np.array_equal(np.array(values).reshape(points, 8), np.asarray(cls.grid).reshape(points, 8))


@pytest.mark.parametrize("type_name", TYPES)
def test_decoding_is_gguf_py_s(type_name):
    import gguf

    rng = np.random.default_rng(5)
    x = rng.normal(0, 0.03, (8, 512)).astype(np.float32)
    got = encode(x, rng.uniform(0, 1, 512).astype(np.float32), type_name)
    theirs = gguf.quants.dequantize(
        np.frombuffer(got.data, dtype=np.uint8).reshape(8, -1), gguf.GGMLQuantizationType[type_name]
    )
    ours = np.frombuffer(native.decode_gguf(type_name, got.data, 16, 256, "F32"), np.float32).reshape(8, 512)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert np.sqrt(((x - ours) ** 2).sum() / (x**2).sum()) < 0.6


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases(), type_name=st.sampled_from(TYPES))
def test_random_rows_are_llama_cpp_s_bytes(reference, case, type_name):  # noqa: F811
    x, qw = case
    if qw is None and type_name in REQUIRED:
        qw = np.ones(x.shape[1], np.float32)
    want = reference(x, qw, type_name)
    if want is not None:
        assert bytes(encode(x, qw, type_name).data) == want
