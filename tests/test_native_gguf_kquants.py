"""qtool.native.encode_gguf for the K-quants (Q2_K..Q6_K) and IQ4_NL against llama.cpp's own
reference quantizers, byte for byte.

The committed fixture (tests/fixtures/gguf_kquants, made by its make_reference.py from llama.cpp's
ggml-quants.c) holds llama.cpp's bytes for real MiniLM rows and adversarial rows; it also checks
the 32-value encoders (made to match gguf-py) against llama.cpp. Where the llama.cpp sources and
gcc are on the machine (LLAMA_CPP_SRC, default the path make_reference.py uses), hypothesis
compares against the compiled reference directly on random rows too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qtool import native
from tests.llama_reference import compiled_llama_cpp
from qtool.errors import KernelError
from qtool.ggml_types import LLAMA_CPP, ggml_type_named

if os.environ.get("QTOOL_REQUIRE_NATIVE") == "1":  # CI: a silently skipped build must fail
    assert native.available(), "qtool.native._kernels was not built (setup.py) or QTOOL_NATIVE=0"
pytestmark = pytest.mark.skipif(not native.available(), reason="qtool.native._kernels is not built")

FIXTURE = Path(__file__).parent / "fixtures" / "gguf_kquants"
KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"]
LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
SIZES = {
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ4_NL": (32, 18),
}
# worst |x - decoded| over a block, as a fraction of the block's largest |x|, on the smooth
# distributions of test_round_trip_error (measured 0.54, 0.26, 0.10, 0.065, 0.021, 0.13), and the
# relative RMS error (measured 0.44, 0.18, 0.084, 0.043, 0.022, 0.088)
MAX_ERROR = {"Q2_K": 0.75, "Q3_K": 0.4, "Q4_K": 0.15, "Q5_K": 0.09, "Q6_K": 0.035, "IQ4_NL": 0.2}
RMS_ERROR = {"Q2_K": 0.5, "Q3_K": 0.22, "Q4_K": 0.1, "Q5_K": 0.055, "Q6_K": 0.03, "IQ4_NL": 0.11}


def manifest():
    return json.loads((FIXTURE / "manifest.json").read_text())


def fixture_rows() -> np.ndarray:
    cols = manifest()["cols"]
    return np.fromfile(FIXTURE / "inputs.f32", dtype="<f4").reshape(-1, cols)


def expected(type_name: str) -> list[bytes]:
    info = manifest()["types"][type_name]
    data = (FIXTURE / f"{type_name}.bin").read_bytes()
    row_bytes = manifest()["cols"] // info["block_size"] * info["type_size"]
    return [data[r * row_bytes : (r + 1) * row_bytes] for r in range(len(data) // row_bytes)]


def encode(type_name: str, x: np.ndarray, dtype: str = "F32") -> native.EncodedBlocks:
    x = np.ascontiguousarray(x)
    rows, cols = x.shape
    return native.encode_gguf(type_name, x.tobytes(), dtype, rows, cols)


def decode(type_name: str, data, values: int) -> np.ndarray:
    block, _ = SIZES[type_name]
    return np.frombuffer(native.decode_gguf(type_name, data, values // block, block, "F32"), dtype=np.float32)


@pytest.fixture
def four_lanes():
    """The 4-lane build of the searches (SSE2 / NEON) instead of the AVX2 one, for one test."""
    from qtool.native import _kernels

    _kernels.kquant_set_lanes(4)
    yield
    _kernels.kquant_set_lanes(8)


# -- the fixture: llama.cpp's bytes ---------------------------------------------------------------


def test_the_fixture_is_what_its_manifest_says():
    import hashlib

    m = manifest()
    assert m["llama_cpp_commit"] == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    for file, digest in m["sha256"].items():
        assert hashlib.sha256((FIXTURE / file).read_bytes()).hexdigest() == digest, file
    assert len(m["labels"]) == fixture_rows().shape[0]
    assert sum(label.startswith("minilm") for label in m["labels"]) >= 30
    total = sum(p.stat().st_size for p in FIXTURE.iterdir())
    assert total < 2_000_000


@pytest.mark.parametrize("lanes", ["avx2", "four"])
@pytest.mark.parametrize("type_name", KQUANTS)
def test_every_fixture_row_is_llama_cpp_s_bytes(type_name, lanes, request):
    if lanes == "four":
        request.getfixturevalue("four_lanes")
    x, labels = fixture_rows(), manifest()["labels"]
    want = expected(type_name)
    wrong = [labels[r] for r in range(x.shape[0]) if bytes(encode(type_name, x[r : r + 1]).data) != want[r]]
    assert not wrong
    # and all rows in one call, split over threads
    assert bytes(encode(type_name, x).data) == b"".join(want)


@pytest.mark.parametrize("type_name", LEGACY)
def test_the_32_value_encoders_are_llama_cpp_s_bytes_too(type_name):
    """Made to match gguf-py, they match llama.cpp on every finite row, but for one thing: an
    all-zero block whose first largest |x| is a -0 (Q4_0, Q5_0) gets d = +0 from gguf-py (which
    takes that -0 as the block's max) and -0 from llama.cpp (which keeps its starting +0). Rows
    with inf or NaN are not encoded natively (errors None: gguf-py does them)."""
    x, labels = fixture_rows(), manifest()["labels"]
    want = expected(type_name)
    for r in range(x.shape[0]):
        got = encode(type_name, x[r : r + 1])
        if not np.isfinite(x[r]).all():
            assert got.errors is None
            continue
        got = bytes(got.data)
        if got == want[r]:
            continue
        assert type_name in ("Q4_0", "Q5_0"), labels[r]
        size = {"Q4_0": 18, "Q5_0": 22}[type_name]
        for b in range(len(got) // size):
            block, ref = got[b * size : (b + 1) * size], want[r][b * size : (b + 1) * size]
            if block != ref:
                values = x[r, 32 * b : 32 * b + 32]
                assert not values.any() and np.signbit(values[0]), labels[r]
                assert block[:2] == b"\x00\x00" and ref[:2] == b"\x00\x80" and block[2:] == ref[2:]


# -- determinism, threads, dtypes, lane widths ------------------------------------------------------


def _matrix(rows=70, cols=768, seed=0):
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-3, 2, (rows, 1))
    return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)


@pytest.mark.parametrize("type_name", KQUANTS)
def test_threads_and_repeats_give_the_same_bytes_and_errors(type_name):
    x = _matrix()
    before = native.threads()
    try:
        native.set_threads(1)
        one = encode(type_name, x)
        native.set_threads(3)
        three = encode(type_name, x)
        again = encode(type_name, x)
    finally:
        native.set_threads(before)
    assert bytes(one.data) == bytes(three.data) == bytes(again.data)
    for field in ("signal", "noise", "max_abs", "count"):
        assert getattr(one.errors, field) == pytest.approx(getattr(three.errors, field), rel=1e-12)


@pytest.mark.parametrize("type_name", KQUANTS)
def test_rows_are_encoded_one_by_one_and_blocks_alone(type_name):
    """llama.cpp quantizes each block on its own values only: a row's bytes are its blocks' bytes."""
    x = _matrix(rows=5, cols=1024, seed=3)
    whole = bytes(encode(type_name, x).data)
    parts = b"".join(
        bytes(encode(type_name, x[r : r + 1, c : c + 256]).data) for r in range(5) for c in range(0, 1024, 256)
    )
    assert whole == parts


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
@pytest.mark.parametrize("type_name", KQUANTS)
def test_half_inputs_are_their_float32_values(type_name, dtype):
    x = _matrix(rows=20, cols=512, seed=5)
    if dtype == "F16":
        src, wide = x.astype(np.float16).tobytes(), x.astype(np.float16).astype(np.float32)
    else:
        bits = x.view(np.uint32).astype(np.uint64)
        halves = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        src, wide = halves.tobytes(), (halves.astype(np.uint32) << 16).view(np.float32)
    got = native.encode_gguf(type_name, src, dtype, 20, 512)
    assert bytes(got.data) == bytes(encode(type_name, wide).data)


# -- round trip and error measures ------------------------------------------------------------------


@pytest.mark.parametrize("type_name", KQUANTS)
def test_round_trip_error(type_name):
    rng = np.random.default_rng(11)
    shape = (64, 1024)
    block = SIZES[type_name][0]
    for x in [
        rng.normal(0, 1, shape),
        rng.uniform(-1, 1, shape),
        rng.laplace(0, 1, shape),
        rng.uniform(0, 1, shape),
        rng.normal(0, 1, shape) * (rng.uniform(size=shape) < 0.1),
    ]:
        x = (x * 0.05).astype(np.float32)
        got = encode(type_name, x)
        y = decode(type_name, got.data, x.size).reshape(-1, block)
        xb = x.reshape(-1, block)
        top = np.abs(xb).max(axis=1)
        fits = top > 1e-3  # a smaller block's scale is a float16 subnormal or 0: coarse by design
        worst = (np.abs(xb - y).max(axis=1)[fits] / top[fits]).max()
        assert worst <= MAX_ERROR[type_name]
        assert np.sqrt(((xb - y) ** 2).sum() / (xb**2).sum()) <= RMS_ERROR[type_name]
        # the error measures are those of the decoded values
        e = x.astype(np.float64).reshape(-1) - y.astype(np.float64).reshape(-1)
        assert got.errors.count == x.size
        assert got.errors.signal == pytest.approx((x.astype(np.float64) ** 2).sum(), rel=1e-9)
        assert got.errors.noise == pytest.approx((e**2).sum(), rel=1e-9)
        assert got.errors.max_abs == np.abs(e).max()


@pytest.mark.parametrize("type_name", KQUANTS)
def test_rows_with_inf_or_nan_are_encoded_without_error_measures(type_name):
    """llama.cpp encodes them (into garbage, but fixed garbage): we give the same bytes, and no
    error measures, as the 32-value encoders do."""
    x = fixture_rows()
    labels = manifest()["labels"]
    bad = [r for r, label in enumerate(labels) if not np.isfinite(x[r]).all()]
    assert len(bad) >= 4
    got = encode(type_name, x[bad])
    assert (
        got.errors is None
    )  # every row written: llama.cpp's types (gguf-py's leave such rows to gguf-py: test_ggml_types.py)
    assert ggml_type_named(type_name).quantizer == LLAMA_CPP
    want = expected(type_name)
    assert bytes(got.data) == b"".join(want[r] for r in bad)


def test_zero_rows_decode_to_zero():
    x = np.zeros((3, 512), np.float32)
    for type_name in KQUANTS:
        got = encode(type_name, x)
        assert not decode(type_name, got.data, x.size).any()
        assert got.errors.noise == 0


# -- hypothesis: random rows, specials included ------------------------------------------------------

SPECIALS = [
    0.0,
    -0.0,
    1e-30,
    -1e-30,
    1e30,
    1e-40,
    -6e-8,
    65504.0,
    1e-15,
    2e-15,
    0.5,
    -0.5,
    1.5,
    np.inf,
    -np.inf,
    np.nan,
]


@st.composite
def rows(draw, cols=256):
    kind = draw(st.sampled_from(["normal", "specials", "integers", "constant"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.normal(0, 10.0 ** draw(st.floats(-8, 8)), cols)
    elif kind == "integers":
        x = rng.integers(-40, 40, cols) / draw(st.sampled_from([1, 2, 4, 8]))
    elif kind == "constant":
        x = np.full(cols, draw(st.sampled_from(SPECIALS[:-3] + [3.0, -7.25])))
    else:
        x = rng.normal(0, 1, cols)
        at = rng.integers(0, cols, draw(st.integers(1, 40)))
        x[at] = rng.choice(np.array(SPECIALS), at.size)
    return x.astype(np.float32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(x=rows(), type_name=st.sampled_from(KQUANTS))
def test_both_lane_widths_agree(x, type_name):
    from qtool.native import _kernels

    wide = bytes(encode(type_name, x[None]).data)
    _kernels.kquant_set_lanes(4)
    try:
        narrow = bytes(encode(type_name, x[None]).data)
    finally:
        _kernels.kquant_set_lanes(8)
    assert wide == narrow


@settings(max_examples=100, deadline=None)
@given(x=rows(), type_name=st.sampled_from(KQUANTS))
def test_decoded_values_stay_near_the_block(x, type_name):
    """On finite rows: a block whose largest |x| is in float16's comfortable range decodes within
    MAX_ERROR of it (over thousands of examples the worst seen was about half that); a tinier one,
    whose scales are float16 subnormals or 0, within its largest |x| (plus a float16 step)."""
    if not np.isfinite(x).all():
        return
    got = encode(type_name, x[None])
    y = decode(type_name, got.data, x.size)
    block = SIZES[type_name][0]
    top = np.abs(x).reshape(-1, block).max(axis=1)
    err = np.abs(x - y).reshape(-1, block).max(axis=1)
    comfortable = (top >= 1e-2) & (top <= 1e4)
    assert (err[comfortable] <= MAX_ERROR[type_name] * top[comfortable]).all()
    small = top < 1e-2
    assert (err[small] <= top[small] + 1e-4).all()


# -- against llama.cpp compiled here, when its sources are on the machine --------------------------


@pytest.fixture(scope="module")
def reference():
    with compiled_llama_cpp() as (make_reference, lib):
        yield lambda type_name, x: make_reference.quantize(lib, type_name, x)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(x=rows(), type_name=st.sampled_from(KQUANTS))
def test_random_rows_are_llama_cpp_s_bytes(reference, x, type_name):
    assert bytes(encode(type_name, x[None]).data) == reference(type_name, x[None])


def test_real_sized_matrix_is_llama_cpp_s_bytes(reference):
    x = _matrix(rows=40, cols=2048, seed=9)
    for type_name in KQUANTS:
        assert bytes(encode(type_name, x).data) == reference(type_name, x), type_name


# -- against the libggml-base llama-quantize itself links, when one is built here ------------------

GGML_BASE = os.environ.get("LLAMA_GGML_BASE", "/work/llama/build/bin/libggml-base.so")
GGML_TYPE_IDS = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20}


def test_llama_quantize_s_own_library_gives_these_bytes():
    """ggml_quantize_chunk without an imatrix, from a cmake build of llama.cpp (LLAMA_GGML_BASE):
    what llama-quantize calls for each tensor."""
    import ctypes

    if not Path(GGML_BASE).is_file():
        pytest.skip(f"no libggml-base at {GGML_BASE} (LLAMA_GGML_BASE)")
    chunk = ctypes.CDLL(GGML_BASE).ggml_quantize_chunk
    chunk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    chunk.restype = ctypes.c_size_t
    for x in [fixture_rows(), _matrix(rows=48, cols=4096, seed=13)]:
        rows, cols = x.shape
        for type_name, type_id in GGML_TYPE_IDS.items():
            block, size = SIZES[type_name]
            out = ctypes.create_string_buffer(rows * cols // block * size)
            written = chunk(type_id, x.ctypes.data, out, 0, rows, cols, None)
            assert bytes(encode(type_name, x).data) == out.raw[:written], type_name


# -- bad arguments ----------------------------------------------------------------------------------


def test_bad_arguments():
    src = bytes(4 * 512 * 4)
    for type_name in ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]:
        with pytest.raises(KernelError, match=f"cols must be a multiple of 256 for {type_name}"):
            native.encode_gguf(type_name, src, "F32", 4, 384)
    with pytest.raises(KernelError, match="cols must be a multiple of 32 for IQ4_NL"):
        native.encode_gguf("IQ4_NL", src, "F32", 4, 48)
    with pytest.raises(KernelError, match="src holds 8192 bytes, needs 16384"):
        native.encode_gguf("Q4_K", src, "F32", 8, 512)
    assert native.encode_gguf("IQ4_NL", src, "F32", 4, 32 * 3).data.nbytes == 4 * 3 * 18


def test_the_kernel_checks_every_size_itself():
    from qtool.native import _kernels

    src, out = bytes(4 * 512 * 4), bytearray(4 * 2 * 144)
    _kernels.encode_gguf("Q4_K", src, 0, 512, out, 0, 4)  # the sizes that fit
    calls = {
        "a multiple of 256": ("Q4_K", src, 0, 384, out, 0, 4),
        "bad layout: cols -256": ("Q6_K", src, 0, -256, out, 0, 4),
        "out holds 1152 bytes, needs 1440": ("Q4_K", bytes(5 * 512 * 4), 0, 512, out, 0, 5),
        "src holds 8192 bytes, needs 10240": ("Q4_K", src, 0, 512, out, 0, 5),
        "the size asked for overflows": ("Q2_K", src, 0, 1 << 61, out, 0, 4),
        "the size asked for overflows ": ("IQ4_NL", src, 0, 512, out, 0, 1 << 62),
    }
    for message, args in calls.items():
        with pytest.raises(ValueError, match=message.strip()):
            _kernels.encode_gguf(*args)
    assert {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"} <= native.gguf_encode_types()
    assert "IQ4_NL" in native.gguf_types()
