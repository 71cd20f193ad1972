"""qtool.native.encode_gguf with importance weights (llama.cpp's quant_weights, what
`llama-quantize --imatrix` passes) against llama.cpp's own quantize_<type>(..., quant_weights),
byte for byte; and IQ4_XS, with and without them.

The committed fixture (tests/fixtures/gguf_kquants, made by make_reference.py from llama.cpp's
ggml-quants.c) holds llama.cpp's bytes for its real MiniLM and adversarial rows under two sets
of importance weights (random, and shaped like llama-imatrix's output with dead columns and
outliers). Where the llama.cpp sources and gcc are on the machine, hypothesis compares against
the compiled reference on random rows and random weights too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qtool import native
from tests.llama_reference import compiled_llama_cpp
from qtool.errors import KernelError
from qtool.ggml_types import ggml_type_named

pytestmark = pytest.mark.skipif(not native.available(), reason="qtool.native._kernels is not built")

FIXTURE = Path(__file__).parent / "fixtures" / "gguf_kquants"
WEIGHTED = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"]
SIZES = {
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
    "Q8_0": (32, 34),
}


def manifest():
    return json.loads((FIXTURE / "manifest.json").read_text())


def fixture_rows() -> np.ndarray:
    return np.fromfile(FIXTURE / "inputs.f32", dtype="<f4").reshape(-1, manifest()["cols"])


def importance(label: str) -> np.ndarray:
    return np.fromfile(FIXTURE / f"importance-{label}.f32", dtype="<f4")


def expected(file: str, type_name: str) -> list[bytes]:
    block, size = SIZES[type_name]
    data = (FIXTURE / file).read_bytes()
    row_bytes = manifest()["cols"] // block * size
    return [data[r * row_bytes : (r + 1) * row_bytes] for r in range(len(data) // row_bytes)]


def encode(type_name: str, x: np.ndarray, qw: np.ndarray | None = None) -> native.EncodedBlocks:
    x = np.ascontiguousarray(x, dtype=np.float32)
    return native.encode_gguf(
        type_name,
        x.tobytes(),
        "F32",
        x.shape[0],
        x.shape[1],
        None if qw is None else np.ascontiguousarray(qw, "<f4").tobytes(),
    )


@pytest.fixture(params=["avx2", "four"])
def lanes(request):
    """Each test once with the widest build of the searches and once with the 4-lane one."""
    from qtool.native import _kernels

    if request.param == "four":
        _kernels.kquant_set_lanes(4)
    yield request.param
    _kernels.kquant_set_lanes(8)


def test_the_fixture_covers_every_weighted_type():
    m = manifest()
    assert sorted(m["weighted"]) == sorted(
        [*WEIGHTED, "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S"]
    )  # the IQ2/IQ3 types: tests/test_native_gguf_iq[23].py
    assert m["importance_sets"] == ["activations", "uniform"]
    assert (importance("activations") == 0).sum() >= 16 and importance("uniform").min() > 0


@pytest.mark.parametrize("label", ["uniform", "activations"])
@pytest.mark.parametrize("type_name", WEIGHTED)
def test_every_fixture_row_is_llama_cpp_s_weighted_bytes(type_name, label, lanes):
    x, labels, qw = fixture_rows(), manifest()["labels"], importance(label)
    want = expected(f"{type_name}.imatrix-{label}.bin", type_name)
    wrong = [labels[r] for r in range(x.shape[0]) if bytes(encode(type_name, x[r : r + 1], qw).data) != want[r]]
    assert not wrong
    got = encode(type_name, x, qw)  # all rows in one call, split over threads
    assert bytes(got.data) == b"".join(want)
    assert got.errors is None  # rows with inf/NaN: llama.cpp's bytes (above), no error measures


def test_the_weights_change_the_bytes():
    """A test that could not fail otherwise: the weighted path is not the plain one."""
    x = fixture_rows()[:30]
    for type_name in WEIGHTED:
        plain = bytes(encode(type_name, x).data)
        assert bytes(encode(type_name, x, importance("activations")).data) != plain, type_name


def test_iq4_xs_without_weights_is_llama_cpp_s_bytes(lanes):
    x = fixture_rows()
    assert bytes(encode("IQ4_XS", x).data) == b"".join(expected("IQ4_XS.bin", "IQ4_XS"))


def test_q8_0_ignores_the_weights_as_llama_cpp_does():
    x = fixture_rows()[:34]
    assert bytes(encode("Q8_0", x, importance("activations")).data) == bytes(encode("Q8_0", x).data)


def test_a_row_s_32_value_blocks_share_the_row_s_sigma2():
    """Q4_0..Q5_1 weight by the mean square of the whole row: the bytes of a block depend on the
    rest of its row (unlike the K-quants, whose sigma2 is their super-block's)."""
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (1, 512)).astype(np.float32)
    qw = rng.uniform(0, 1, 512).astype(np.float32)
    loud = x.copy()
    loud[0, 256:] *= 100
    assert bytes(encode("Q4_0", x, qw).data)[:144] != bytes(encode("Q4_0", loud, qw).data)[:144]
    assert bytes(encode("Q4_K", x, qw).data)[:144] == bytes(encode("Q4_K", loud, qw).data)[:144]


def test_iq4_xs_round_trip():
    rng = np.random.default_rng(8)
    x = (rng.normal(0, 0.05, (32, 1024))).astype(np.float32)
    got = encode("IQ4_XS", x)
    y = np.frombuffer(native.decode_gguf("IQ4_XS", got.data, x.size // 256, 256, "F32"), np.float32).reshape(x.shape)
    assert np.sqrt(((x - y) ** 2).sum() / (x**2).sum()) < 0.11
    e = x.astype(np.float64) - y
    assert got.errors.noise == pytest.approx((e**2).sum(), rel=1e-9)
    assert "IQ4_XS" in native.gguf_encode_types() and "IQ4_XS" in native.gguf_types()


def test_bad_importance():
    x = np.zeros((2, 512), np.float32)
    with pytest.raises(KernelError, match="importance holds 1024 bytes, needs 2048"):
        encode("Q4_K", x, np.ones(256, np.float32))
    from qtool.native import _kernels

    with pytest.raises(ValueError, match="encode_gguf importance holds 1024 bytes, needs 2048"):
        _kernels.encode_gguf("Q4_K", x.tobytes(), 0, 512, bytearray(2 * 2 * 144), 0, 2, bytes(1024))


# -- against llama.cpp compiled here, when its sources are on the machine --------------------------


@pytest.fixture(scope="module")
def reference():
    with compiled_llama_cpp() as (make_reference, lib):

        def run(type_name, x, qw):
            if qw is None:
                return make_reference.quantize(lib, type_name, x)
            return make_reference.quantize_weighted(lib, type_name, x, qw)

        yield run


SPECIALS = [0.0, -0.0, 1e-30, 1e30, 1e-40, 1e-15, 0.5, 1.5, np.inf, -np.inf, np.nan]


@st.composite
def weighted_rows(draw):
    cols = 256 * draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "specials", "integers", "one-signed"]))
    if kind == "normal":
        x = rng.normal(0, 10.0 ** draw(st.floats(-6, 6)), cols)
    elif kind == "integers":
        x = rng.integers(-40, 40, cols) / draw(st.sampled_from([1, 2, 4, 8]))
    elif kind == "one-signed":
        x = rng.uniform(0, 10.0 ** draw(st.floats(-4, 2)), cols) * draw(st.sampled_from([1, -1]))
    else:
        x = rng.normal(0, 1, cols)
        at = rng.integers(0, cols, draw(st.integers(1, 30)))
        x[at] = rng.choice(np.array(SPECIALS), at.size)
    weights = draw(st.sampled_from(["uniform", "lognormal", "sparse", "zeros", "huge"]))
    if weights == "uniform":
        qw = rng.uniform(0, 1, cols)
    elif weights == "lognormal":
        qw = np.exp(rng.normal(-3, 3, cols))
    elif weights == "sparse":
        qw = np.where(rng.uniform(size=cols) < 0.2, rng.uniform(0, 5, cols), 0.0)
    elif weights == "zeros":
        qw = np.zeros(cols)
    else:
        qw = rng.uniform(0, 1e30, cols)
    return x.astype(np.float32)[None], qw.astype(np.float32)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=weighted_rows(), type_name=st.sampled_from(WEIGHTED))
def test_random_rows_and_weights_are_llama_cpp_s_bytes(reference, case, type_name):
    x, qw = case
    assert bytes(encode(type_name, x, qw).data) == reference(type_name, x, qw)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=weighted_rows())
def test_random_rows_are_llama_cpp_s_iq4_xs_bytes(reference, case):
    x, _ = case
    assert bytes(encode("IQ4_XS", x).data) == reference("IQ4_XS", x, None)


def test_real_sized_matrix_is_llama_cpp_s_bytes(reference):
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((24, 2048)) * 10.0 ** rng.uniform(-3, 1, (24, 1))).astype(np.float32)
    qw = np.exp(rng.normal(-2, 1.5, 2048)).astype(np.float32)
    for type_name in WEIGHTED:
        assert bytes(encode(type_name, x, qw).data) == reference(type_name, x, qw), type_name


# -- the encoder hands the kernels the job's importance ---------------------------------------------


def _job(shape, type_name, importance, dtype="F32"):
    from types import SimpleNamespace

    from qtool.plan import GgmlBlocks, Job, OutputTensor

    weight = SimpleNamespace(
        name="blk.0.ffn_up.weight",
        shape=shape,
        quantized=False,
        data=SimpleNamespace(dtype=SimpleNamespace(name=dtype)),
    )
    return Job(
        weight,
        "quantize",
        [OutputTensor("out", type_name, shape, 0)],
        encoding=GgmlBlocks(ggml_type_named(type_name), importance=importance),
    )


def _run_encoder(job, values, monkeypatch, piece_values):
    from qtool.encoders import ggml_blocks

    monkeypatch.setattr(ggml_blocks, "ENCODE_VALUES", piece_values)
    encoder = ggml_blocks.GgmlBlockEncoder(job, measure=True, native=True)
    return b"".join(bytes(data) for _, data, _ in encoder.encode(values)), encoder.errors


@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_0", "IQ4_XS"])
def test_the_encoder_passes_the_importance_of_a_2d_weight(type_name, monkeypatch):
    rng = np.random.default_rng(21)
    x = rng.normal(0, 0.02, (10, 512)).astype(np.float32)
    qw = np.exp(rng.normal(-2, 1.5, 512)).astype(np.float32)
    data, errors = _run_encoder(_job((10, 512), type_name, qw), x.tobytes(), monkeypatch, 3 * 512)  # pieces of 3 rows
    assert data == bytes(encode(type_name, x, qw).data)
    assert errors.count == x.size and errors.noise > 0


@pytest.mark.parametrize("type_name", ["Q2_K", "Q5_1"])
def test_each_expert_of_a_3d_weight_gets_its_own_importance(type_name, monkeypatch):
    """As llama-quantize hands expert e's slice imatrix + e * n_per_row; pieces of 5 rows cross
    the 4-row expert boundaries."""
    rng = np.random.default_rng(22)
    experts, rows, cols = 3, 4, 256
    x = rng.normal(0, 0.02, (experts, rows, cols)).astype(np.float32)
    qw = np.exp(rng.normal(-2, 1.5, (experts, cols))).astype(np.float32)
    data, _ = _run_encoder(_job((experts, rows, cols), type_name, qw), x.tobytes(), monkeypatch, 5 * cols)
    want = b"".join(bytes(encode(type_name, x[e], qw[e]).data) for e in range(experts))
    assert data == want
    assert data != b"".join(bytes(encode(type_name, x[e], qw[0]).data) for e in range(experts))


def test_the_encoder_refuses_importance_without_the_native_kernels():
    from qtool.encoders.ggml_blocks import GgmlBlockEncoder
    from qtool.errors import UsageError

    with pytest.raises(
        UsageError, match="blk.0.ffn_up.weight: quantizing with an importance matrix needs qtool's native kernels"
    ):
        GgmlBlockEncoder(_job((2, 256), "Q4_0", np.ones(256, np.float32)), measure=False, native=False)


def test_the_encoder_refuses_iq2_xxs_without_an_importance_matrix():
    from qtool.encoders.ggml_blocks import GgmlBlockEncoder
    from qtool.errors import UsageError

    with pytest.raises(UsageError, match="blk.0.ffn_up.weight: IQ2_XXS needs an importance matrix"):
        GgmlBlockEncoder(_job((2, 256), "IQ2_XXS", None), measure=False, native=True)
