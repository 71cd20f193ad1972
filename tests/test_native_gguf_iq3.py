"""qtool.native's IQ3_S and IQ3_XXS encoders against llama.cpp's quantize_iq3_s and
quantize_iq3_xxs, with and without importance weights, byte for byte; their decoders against
gguf-py's. (llama-quantize refuses IQ3_XXS without an imatrix for most tensors; the kernel, like
llama.cpp's, has both paths.)

The fixture (tests/fixtures/gguf_kquants, make_reference.py) holds llama.cpp's bytes for every
row llama.cpp does not abort on (its manifest lists those: inf, NaN and values whose squares
overflow). Where llama.cpp's sources and gcc are here, hypothesis compares random rows too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qtool import native
from tests.llama_reference import compiled_llama_cpp

pytestmark = pytest.mark.skipif(not native.available(), reason="qtool.native._kernels is not built")

FIXTURE = Path(__file__).parent / "fixtures" / "gguf_kquants"
ROW_BYTES = {"IQ3_S": 110, "IQ3_XXS": 98}  # one super-block per fixture row of 256
TYPES = list(ROW_BYTES)


def manifest():
    return json.loads((FIXTURE / "manifest.json").read_text())


def fixture_rows() -> np.ndarray:
    return np.fromfile(FIXTURE / "inputs.f32", dtype="<f4").reshape(-1, 256)


def encode(x: np.ndarray, qw: np.ndarray | None = None, type_name: str = "IQ3_S") -> native.EncodedBlocks:
    x = np.ascontiguousarray(x, dtype=np.float32)
    return native.encode_gguf(
        type_name,
        x.tobytes(),
        "F32",
        x.shape[0],
        x.shape[1],
        None if qw is None else np.ascontiguousarray(qw, "<f4").tobytes(),
    )


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize(
    "suffix, importance",
    [(".bin", None), (".imatrix-uniform.bin", "uniform"), (".imatrix-activations.bin", "activations")],
)
def test_every_fixture_row_is_llama_cpp_s_bytes(type_name, suffix, importance):
    m, file, size = manifest(), type_name + suffix, ROW_BYTES[type_name]
    x, labels = fixture_rows(), m["labels"]
    qw = None if importance is None else np.fromfile(FIXTURE / f"importance-{importance}.f32", dtype="<f4")
    want = (FIXTURE / file).read_bytes()
    aborted = set(m["aborts"].get(file, []))
    assert len(aborted) <= 10 and "sub-blocks zero but one" not in aborted
    got = bytes(encode(x, qw, type_name).data)
    wrong = [
        labels[r]
        for r in range(x.shape[0])
        if labels[r] not in aborted and got[r * size : (r + 1) * size] != want[r * size : (r + 1) * size]
    ]
    assert not wrong
    assert sum(label.startswith("minilm") for label in labels if label not in aborted) >= 30


def test_a_zero_block_shifts_the_codes_after_it_as_llama_cpp_does():
    """llama.cpp skips a block of 32 whose values are all 0 without moving its code pointers:
    the next block's codes land in its place, and the last block's stay zero."""
    rng = np.random.default_rng(3)
    x = rng.normal(0, 1, (1, 256)).astype(np.float32)
    x[0, 32:64] = 0
    got = bytes(encode(x).data)
    qs = got[2:66]
    assert qs[56:64] == bytes(8)  # the eighth block's 8 code bytes were never written
    alone = bytes(encode(np.concatenate([x[:, :32], x[:, 64:], np.zeros((1, 32), np.float32)], axis=1)).data)
    assert alone[2:58] == qs[:56]


@pytest.mark.parametrize("name, size", [("IQ3_S", 512), ("IQ3_XXS", 256)])
def test_the_grids_are_gguf_py_s(name, size):
    import gguf.quants

    cls = getattr(gguf.quants, name)
    cls.init_grid()
    text = (Path(native.__file__).parent / "src" / "iq3_grids.h").read_text()
    table = text[text.index(f"{name.lower().replace('_', '')}_grid[{size}][4] = {{") :]
    table = table[table.index("= {") + 3 : table.index("};")]
    values = [int(v) for v in table.replace("{", " ").replace("}", " ").replace(",", " ").split()]
    assert np.array_equal(np.array(values).reshape(size, 4), np.asarray(cls.grid).reshape(size, 4))


@pytest.mark.parametrize("type_name", TYPES)
def test_decoding_is_gguf_py_s_and_the_errors_are_the_decoded_values(type_name):
    import gguf

    rng = np.random.default_rng(5)
    x = (rng.normal(0, 0.03, (16, 512)) * rng.uniform(0.1, 3, (16, 1))).astype(np.float32)
    got = encode(x, None, type_name)
    blocks = np.frombuffer(got.data, dtype=np.uint8).reshape(16, -1)
    theirs = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name])
    ours = np.frombuffer(native.decode_gguf(type_name, got.data, 32, 256, "F32"), np.float32).reshape(16, 512)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert np.sqrt(((x - ours) ** 2).sum() / (x**2).sum()) < 0.3
    assert got.errors.noise == pytest.approx(((x.astype(np.float64) - ours) ** 2).sum(), rel=1e-9)


@pytest.mark.parametrize("type_name", TYPES)
def test_threads_give_the_same_bytes(type_name):
    x = np.random.default_rng(6).normal(0, 1, (64, 512)).astype(np.float32)
    before = native.threads()
    try:
        native.set_threads(1)
        one = bytes(encode(x, None, type_name).data)
        native.set_threads(3)
        three = bytes(encode(x, None, type_name).data)
    finally:
        native.set_threads(before)
    assert one == three


# -- against llama.cpp compiled here ----------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    with compiled_llama_cpp() as (make_reference, lib):

        def run(x, qw, type_name):
            aborted: list[int] = []
            data = (
                make_reference.quantize(lib, type_name, x, aborted)
                if qw is None
                else make_reference.quantize_weighted(lib, type_name, x, qw, aborted)
            )
            return None if aborted else data

        yield run


@st.composite
def cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cols = 256 * draw(st.integers(1, 2))
    kind = draw(st.sampled_from(["normal", "integers", "sparse", "zero blocks", "one-signed"]))
    x = rng.normal(0, 10.0 ** draw(st.floats(-5, 4)), cols)
    if kind == "integers":
        x = rng.integers(-20, 20, cols) / draw(st.sampled_from([1, 2, 4]))
    elif kind == "sparse":
        x = np.where(rng.uniform(size=cols) < 0.1, x, 0.0)
    elif kind == "zero blocks":
        x.reshape(-1, 32)[rng.uniform(size=cols // 32) < 0.4] = 0
    elif kind == "one-signed":
        x = np.abs(x) * draw(st.sampled_from([1, -1]))
    weights = draw(st.sampled_from([None, "uniform", "lognormal", "sparse"]))
    qw = None
    if weights == "uniform":
        qw = rng.uniform(0, 1, cols)
    elif weights == "lognormal":
        qw = np.exp(rng.normal(-3, 2, cols))
    elif weights == "sparse":
        qw = np.where(rng.uniform(size=cols) < 0.3, rng.uniform(0, 5, cols), 0.0)
    return x.astype(np.float32)[None], None if qw is None else qw.astype(np.float32)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases(), type_name=st.sampled_from(TYPES))
def test_random_rows_are_llama_cpp_s_bytes(reference, case, type_name):
    x, qw = case
    want = reference(x, qw, type_name)
    if want is not None:
        assert bytes(encode(x, qw, type_name).data) == want
