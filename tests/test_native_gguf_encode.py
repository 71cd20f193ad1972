"""qtool.native.encode_gguf against gguf-py's numpy quantizer, byte for byte: every type, every
input dtype, on the values where its rounding is decided. The error sums are checked against
float64 sums over gguf.quants.dequantize of gguf-py's own bytes."""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool import native

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402 - once the package is known to be there

if os.environ.get("QTOOL_REQUIRE_NATIVE") == "1":  # CI: a silently skipped build must fail
    assert native.available(), "qtool.native._kernels was not built (setup.py) or QTOOL_NATIVE=0"
pytestmark = pytest.mark.skipif(not native.available(), reason="qtool.native._kernels is not built")

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


@pytest.fixture(autouse=True, params=["avx512", "portable"])
def rows_kernel(request):
    """Every test twice: with gguf_encode.c's AVX-512 Q8_0 rows and error sums (where the CPU
    has them), and with its portable ones."""
    on = request.param == "avx512"
    try:
        if native._kernels.gguf_set_avx512(on) != on:
            pytest.skip("this CPU has no AVX-512")
        yield request.param
    finally:
        native._kernels.gguf_set_avx512(True)


DTYPES = ["F32", "F16", "BF16"]
F16_MAX = 65504.0


def as_dtype(values: np.ndarray, dtype: str) -> tuple[bytes, np.ndarray]:
    """(the bytes of `values` in `dtype`, those values widened back to float32)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "F32":
        return values.tobytes(), values
    if dtype == "F16":
        with np.errstate(over="ignore"):
            halves = values.astype(np.float16)
        return halves.tobytes(), halves.astype(np.float32)
    bits = values.view(np.uint32).astype(np.uint64)  # bf16: round to nearest even (finite values)
    bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return bf16.tobytes(), (bf16.astype(np.uint32) << 16).view(np.float32)


def gguf_py(values: np.ndarray, type_name: str) -> bytes:
    with warnings.catch_warnings():  # its casts warn on the NaN codes of a subnormal d
        warnings.simplefilter("ignore", RuntimeWarning)
        return gguf_quants.quantize(values, GGMLQuantizationType[type_name]).tobytes()


def first_zero_rule(want: bytes, values: np.ndarray, type_name: str) -> bytes:
    """gguf-py's bytes with the sign of a zero min/max (Q4_1, Q5_1) taken from the block's
    first value, as our kernel (and ggml's C reference) does; numpy's SIMD reduction order
    decides it in gguf-py, differently on different machines. Blocks whose min and max are
    not a zero with both signs present are left alone.

    Q4_0 and Q5_0: for an all-zero block ggml's loop keeps its starting max of +0, so d = +0 / -8
    is -0 whatever the zeros' signs; gguf-py takes the first value, so a leading -0 gives +0."""
    blocks = values.reshape(-1, 32)
    if type_name in ("Q4_0", "Q5_0"):
        out = np.frombuffer(want, dtype=np.uint8).reshape(len(blocks), -1).copy()
        out[(blocks == 0).all(axis=1), 0:2] = np.array([-0.0], dtype=np.float16).view(np.uint8)
        return out.tobytes()
    if type_name not in ("Q4_1", "Q5_1"):
        return want
    out = np.frombuffer(want, dtype=np.uint8).reshape(len(blocks), -1).copy()
    zero = blocks == 0
    mixed = (np.signbit(blocks) & zero).any(axis=1) & (~np.signbit(blocks) & zero).any(axis=1)
    for b in np.flatnonzero(mixed & ((blocks.min(axis=1) == 0) | (blocks.max(axis=1) == 0))):
        block = blocks[b]
        lo, hi = block[np.argmin(block)], block[np.argmax(block)]  # argmin/argmax: the first
        d = (hi - lo) / np.float32(15 if type_name == "Q4_1" else 31)
        out[b, 0:2] = np.array([d], dtype=np.float32).astype(np.float16).view(np.uint8)
        out[b, 2:4] = np.array([lo], dtype=np.float32).astype(np.float16).view(np.uint8)
    return out.tobytes()


def reference_errors(values: np.ndarray, data: bytes, type_name: str) -> dict[str, float]:
    """The sums in float64 over gguf-py's decoder, and the sizes their tolerances scale with."""
    rows = values.shape[0]
    decoded = gguf_quants.dequantize(
        np.frombuffer(data, dtype=np.uint8).reshape(rows, -1), GGMLQuantizationType[type_name]
    )
    x, y = values.astype(np.float64), decoded.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        e = x - y
        return {
            "xx": float(np.sum(x * x)),
            "xe": float(np.sum(x * e)),
            "ee": float(np.sum(e * e)),
            "xy": float(np.sum(x * y)),
            "yy": float(np.sum(y * y)),
            "max": float(np.max(np.abs(e))) if e.size else 0.0,
            "|xe|": float(np.sum(np.abs(x * e))),
        }


def close(got: float, want: float, size: float) -> bool:
    """Equal to 1e-9 of `size`; inf and NaN (a float16 d of inf decodes to inf, or NaN times a 0
    code) equal only themselves."""
    if not math.isfinite(want):
        return math.isnan(got) if math.isnan(want) else got == want
    return abs(got - want) <= 1e-9 * size


def check(values: np.ndarray, type_name: str, dtype: str) -> None:
    """Encode `values` [rows, cols] given in `dtype`: bytes and error sums as gguf-py's."""
    from qtool.native import _kernels

    src, widened = as_dtype(values, dtype)
    rows, cols = widened.shape
    got = native.encode_gguf(type_name, src, dtype, rows, cols)
    if not np.isfinite(widened).all():  # e.g. float16 past 65504: gguf-py's job
        assert got.errors is None
        return
    want = first_zero_rule(gguf_py(widened, type_name), widened, type_name)
    if bytes(got.data) != want:
        size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
        have = np.frombuffer(got.data, dtype=np.uint8).reshape(-1, size)
        bad = np.flatnonzero((have != np.frombuffer(want, dtype=np.uint8).reshape(-1, size)).any(axis=1))
        b = int(bad[0])
        raise AssertionError(
            f"{type_name} from {dtype}: {len(bad)} of {len(have)} blocks differ; block {b}:\n"
            f"  values {widened.reshape(-1, 32)[b].tolist()}\n  got  {have[b].tobytes().hex()}\n  want {want[b * size : (b + 1) * size].hex()}"
        )
    ref = reference_errors(widened, want, type_name)
    # the kernel's own sums, one range: x.x, x.e, e.e and max |e|
    xx, xe, ee, max_err, finite = _kernels.encode_gguf(
        type_name, src, native.DTYPE_CODES[dtype], cols, bytearray(len(want)), 0, rows
    )
    assert finite
    assert close(xx, ref["xx"], ref["xx"]) and close(ee, ref["ee"], ref["ee"]), (xx, ee, ref)
    assert close(xe, ref["xe"], ref["|xe|"]), (xe, ref)
    assert max_err == ref["max"] or (math.isnan(max_err) and math.isnan(ref["max"])), (max_err, ref)
    # what ErrorStats makes of them, split over threads
    errors = got.errors
    assert errors is not None and errors.count == rows * cols
    size = sum(term for term in (ref["xx"], ref["|xe|"], ref["ee"]) if math.isfinite(term))
    assert close(errors.signal, ref["xx"], size) and close(errors.noise, ref["ee"], size), (errors, ref)
    if math.isfinite(ref["xe"]) and math.isfinite(ref["ee"]):  # dot and recon are derived: inf - inf is NaN
        assert close(errors.dot, ref["xy"], size) and close(errors.recon, ref["yy"], size), (errors, ref)
    assert errors.max_abs == max_err or (math.isnan(errors.max_abs) and math.isnan(max_err))


# -- the cases: [rows, cols] float32 values, given the input dtype ----------------------------------


def _ties(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Blocks whose d is 1 (or -1) exactly, for each type, filled with k + 0.5: every x * id
    lands on a .5, where round-away (Q8_0) and trunc(... + .5) decide."""
    out = np.empty((rows, cols), dtype=np.float32)
    for r in range(rows):
        kind = r % 6
        low, high = [(-127, 127), (-8, 8), (0, 15), (-16, 16), (0, 31), (-3, 3)][kind]
        row = rng.integers(low, high, size=cols) + 0.5
        row = row.reshape(-1, 32)
        row[:, 0] = [127, -8, 0, -16, 0, -8.5][kind]  # sets max |x| (or min) of each block
        if kind in (2, 4):
            row[:, 1] = high
        out[r] = row.reshape(-1)
    return out


def _case(name: str, dtype: str, seed: int = 0, rows: int = 48, cols: int = 256) -> np.ndarray:
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal((rows, cols)).astype(np.float32)
    top = F16_MAX if dtype == "F16" else 3.0e38
    if name == "normal":
        return normal * 0.02
    if name == "heavy_tailed":
        return (rng.standard_t(1.5, (rows, cols)) * 0.01).astype(np.float32)
    if name == "zero_rows":
        normal[::3] = 0.0
        normal[1::7, :64] = 0.0
        return normal
    if name == "one_signed":
        normal[::2] = np.abs(normal[::2])
        normal[1::2] = -np.abs(normal[1::2])
        normal[::4, ::5] = 0.0  # min (or max) exactly 0
        return normal
    if name == "ties":
        return _ties(rng, rows, cols)
    if name == "near_f16_max":
        return normal / np.abs(normal).max() * np.float32(F16_MAX * 0.999)
    if name == "past_f16_max":  # d overflows float16 (a float16 input can't, it is inf already)
        scale = np.logspace(5, 37, rows, dtype=np.float32)[:, None] if dtype != "F16" else np.float32(F16_MAX)
        return (normal / np.abs(normal).max() * scale).astype(np.float32)
    if name == "near_f32_max":  # Q4_1's max - min overflows float32 too
        return (rng.uniform(-1, 1, (rows, cols)) * top).astype(np.float32)
    if name == "tiny":  # subnormal d, and 1 / d overflowing to inf
        scale = np.logspace(-45, -30, rows)[:, None] if dtype != "F16" else np.logspace(-8, -4, rows)[:, None]
        return (normal * scale).astype(np.float32)
    if name == "scale_rounds_to_0":  # d under float16's smallest subnormal
        return (normal * (1e-9 if dtype != "F16" else 3e-7)).astype(np.float32)
    raise KeyError(name)


CASES = [
    "normal",
    "heavy_tailed",
    "zero_rows",
    "one_signed",
    "ties",
    "near_f16_max",
    "past_f16_max",
    "near_f32_max",
    "tiny",
    "scale_rounds_to_0",
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("type_name", TYPES)
def test_bytes_and_errors_match_gguf_py(type_name, dtype, case):
    check(_case(case, dtype), type_name, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("type_name", TYPES)
def test_rows_of_many_chunks(type_name, dtype):
    """The kernel works out scales 64 blocks at a time: rows of 150 blocks (two chunks and a
    part), block magnitudes spread over 2^-40 .. 2^40, a zero block astride a chunk's end."""
    rng = np.random.default_rng(11)
    values = rng.standard_normal((5, 150, 32)) * 2.0 ** rng.integers(-40, 40, size=(5, 150, 1))
    values[2, 63:65] = 0.0
    with np.errstate(over="ignore"):
        check(values.reshape(5, -1).astype(np.float32), type_name, dtype)


def test_cases_reach_the_edges():
    """The cases meet what they are named after: a float16 d of inf, of 0, a subnormal d whose
    inverse is inf, and blocks of x * id on exact .5 ties."""
    tiny = _case("tiny", "F32").reshape(-1, 32)
    d = np.abs(tiny).max(axis=1) / np.float32(127)
    with np.errstate(divide="ignore"):
        assert np.isinf(np.float32(1) / d[d > 0]).any()
    past = _case("past_f16_max", "F32").reshape(-1, 32)
    assert (np.abs(past).max(axis=1) / 127 > F16_MAX).any()
    zero_scale = _case("scale_rounds_to_0", "F32").reshape(-1, 32)
    assert (np.abs(zero_scale).max(axis=1).astype(np.float16) == 0).all()
    ties = _case("ties", "F32")[0].reshape(-1, 32)
    assert np.all(ties[:, 0] == 127) and np.all(ties[:, 1:] % 1 == 0.5)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 40),
    blocks=st.integers(1, 8),
    exponent=st.integers(-140, 120),
    shift=st.floats(-3, 3),
    specials=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    type_name=st.sampled_from(TYPES),
)
def test_matches_gguf_py_on_random_shapes_and_magnitudes(
    seed, rows, blocks, exponent, shift, specials, dtype, type_name
):
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((rows, blocks * 32)) + shift) * 2.0**exponent
    if specials:  # signed zeros, ties, repeated maxima
        picks = rng.integers(0, 4, size=values.shape)
        values = np.where(picks == 0, 0.0, values)
        values = np.where(picks == 1, -0.0, values)
        values = np.where(picks == 2, np.round(values) + 0.5, values)
    with np.errstate(over="ignore"):
        check(values.astype(np.float32), type_name, dtype)


def test_signed_zero_ties_take_the_first_value():
    """Q4_1/Q5_1 with a zero min: the stored m is the first zero of the block, +0 or -0."""
    values = np.zeros((2, 32), dtype=np.float32)
    values[0, 3], values[0, 9] = -0.0, 0.0
    values[0, 10:] = 1.0
    values[1, :] = -0.0
    values[1, 5] = 0.0
    for type_name in ("Q4_1", "Q5_1"):
        got = np.frombuffer(native.encode_gguf(type_name, values.tobytes(), "F32", 2, 32).data, dtype=np.uint8).reshape(
            2, -1
        )
        m = got[:, 2:4].copy().view(np.float16)[:, 0]
        d = got[:, 0:2].copy().view(np.float16)[:, 0]
        assert not np.signbit(m[0]) and np.signbit(m[1])  # row 0 starts with +0, row 1 with -0
        assert d[1] == 0 and not np.signbit(d[1])  # -0 - -0 = +0


def test_thread_splits_give_the_same_bytes():
    values = _case("normal", "BF16", seed=5, rows=300, cols=512)
    values[7, :40] = 0.0
    src, _ = as_dtype(values, "BF16")
    try:
        native.set_threads(1)
        one = native.encode_gguf("Q4_1", src, "BF16", 300, 512)
        native.set_threads(4)
        assert len(native._split(300)) == 4
        four = native.encode_gguf("Q4_1", src, "BF16", 300, 512)
    finally:
        native.set_threads(None)
    assert bytes(one.data) == bytes(four.data)
    assert one.errors.max_abs == four.errors.max_abs
    assert one.errors.noise == pytest.approx(four.errors.noise, rel=1e-12)
    assert one.errors.signal == pytest.approx(four.errors.signal, rel=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_values_are_left_to_gguf_py(dtype, bad):
    values = _case("normal", dtype, rows=40, cols=64)
    values[33, 17] = bad
    src, _ = as_dtype(values, dtype)
    assert native.encode_gguf("Q8_0", src, dtype, 40, 64).errors is None


def test_empty_weights():
    for rows, cols in [(0, 64), (5, 0), (0, 0)]:
        got = native.encode_gguf("Q4_0", b"", "F16", rows, cols)
        assert got.data.nbytes == 0 and got.errors.count == 0


def test_the_kernel_table_is_gguf_py_s():
    assert native.gguf_encode_types() >= frozenset(TYPES)  # and the K-quants: test_native_gguf_kquants.py
    for name, sizes in native._gguf_encoders().items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]] == sizes


def test_bad_arguments_are_value_errors():
    src = bytes(4 * 64 * 2)
    with pytest.raises(ValueError, match="no native GGUF encoder for 'IQ1_S'"):
        native.encode_gguf("IQ1_S", src, "BF16", 4, 64)
    with pytest.raises(ValueError, match="dtype 'F64'"):
        native.encode_gguf("Q8_0", src, "F64", 4, 64)
    with pytest.raises(ValueError, match="cols must be a multiple of 32"):
        native.encode_gguf("Q8_0", src, "BF16", 4, 48)
    with pytest.raises(ValueError, match="cols must be a multiple of 32"):
        native.encode_gguf("Q8_0", src, "BF16", -1, 64)
    with pytest.raises(ValueError, match="encode_gguf src holds 512 bytes, needs 640"):
        native.encode_gguf("Q8_0", src, "BF16", 5, 64)
    with pytest.raises(ValueError, match="encode_gguf src holds 512 bytes, needs"):
        native.encode_gguf("Q8_0", src, "BF16", 1 << 62, 64)
    with pytest.raises(ValueError, match="encode_gguf src holds 512 bytes, needs"):
        native.encode_gguf("Q8_0", src, "BF16", 1, 1 << 62)


def test_the_kernel_checks_every_size_itself():
    """Called directly with hostile sizes, the C entry point refuses before touching memory."""
    from qtool.native import _kernels

    src, out = bytes(4 * 64 * 2), bytearray(4 * 2 * 34)
    _kernels.encode_gguf("Q8_0", src, 2, 64, out, 0, 4)  # the sizes that fit
    calls = {
        "no native encoder for GGUF IQ1_S": ("IQ1_S", src, 2, 64, out, 0, 4),
        "unknown dtype code 3": ("Q8_0", src, 3, 64, out, 0, 4),
        "a multiple of 32": ("Q8_0", src, 2, 48, out, 0, 4),
        "bad layout: cols -64": ("Q8_0", src, 2, -64, out, 0, 4),
        "rows \\[-1, 4\\)": ("Q8_0", src, 2, 64, out, -1, 4),
        "rows \\[3, 2\\)": ("Q8_0", src, 2, 64, out, 3, 2),
        "src holds 512 bytes, needs 640": ("Q8_0", src, 2, 64, out, 0, 5),
        "out holds 272 bytes, needs 340": ("Q8_0", bytes(5 * 64 * 2), 2, 64, out, 0, 5),
        "src: the size asked for overflows": ("Q8_0", src, 2, 64, out, 0, 1 << 62),
        "src: the size asked for overflows ": ("Q8_0", src, 2, 1 << 61, out, 0, 4),
        "src holds 512 bytes, needs 2147483648": ("Q8_0", src, 0, 1 << 29, out, 0, 1),
    }
    for message, args in calls.items():
        with pytest.raises(ValueError, match=message.strip()):
            _kernels.encode_gguf(*args)
    with pytest.raises(TypeError):
        _kernels.encode_gguf("Q8_0", src, 2, 64, bytes(out), 0, 4)  # read-only out
