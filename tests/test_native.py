"""qtool.native's fused int kernels against the torch kernels they stand in for: bit for bit,
on adversarial values, every dtype, every packed width, split across threads; and the pipeline
running them without importing torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool import native, native_decoders
from qtool.error_measures import ErrorStats
from qtool.layouts.compressed_tensors import CompressedTensors, encode
from qtool.scheme_strings import parse_scheme

from .conftest import REPO, SAMPLES

if os.environ.get("QTOOL_REQUIRE_NATIVE") == "1":  # CI: a silently skipped build must fail
    assert native.available(), "qtool.native._kernels was not built (setup.py) or QTOOL_NATIVE=0"
pytestmark = pytest.mark.skipif(not native.available(), reason="qtool.native._kernels is not built")

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
SCHEMES = [
    ("int8", 8, None),
    ("W4A16", 4, 128),
    ("int4:g64", 4, 64),
    ("int2:g64", 2, 64),
    ("W8A16", 8, 128),
    ("int3:g64", 3, 64),
]
ASYM_SCHEMES = [
    ("W4A16_ASYM", 4, 128),
    ("int8:asym", 8, None),
    ("int4:g64:asym", 4, 64),
    ("int2:g64:asym", 2, 64),
    ("int3:g128:asym", 3, 128),
]
# int3 (issue 19): encoded natively, a dense stream (fields cross int32 words); decoded by torch


def _bytes(tensor: torch.Tensor):
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return memoryview(tensor.detach().cpu().view(ints).numpy().tobytes())  # numpy copes with any strides


def _weight(seed: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes, plus the values where rounding is decided: zeros,
    an all-zero row, subnormals, exact ties of x / scale, the dtype's largest values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 4, rows).unsqueeze(1)
    w[0] = 0
    w[1, ::3] = torch.finfo(dtype).tiny / 4  # subnormals
    w[2] = torch.arange(cols) % 17 - 8.5  # many x / scale land on exact .5 ties
    w[3, :4] = min(torch.finfo(dtype).max / 2, 2.0**60)  # huge, but its square is finite
    w[4] = w[4].abs()  # min 0: the zero point sits at qmin
    w[5] = -w[5].abs()  # max 0
    w[6, : cols // 2] = 3.0  # one group constant
    w[7] = torch.randn(cols, generator=g) * 1e-6  # float16: (max - min) / range rounds to a 0 scale
    w[8] = torch.randn(cols, generator=g) * 1e-37  # bfloat16 / float32: the same, far down
    return w.to(dtype)


def _native_encode(w: torch.Tensor, dtype: str, bits: int, group: int, symmetric: bool = True):
    rows, cols = w.shape
    return native.encode_int(_bytes(w), dtype, rows, cols, group, bits, symmetric)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "scheme,bits,group,symmetric", [(*s, True) for s in SCHEMES] + [(*s, False) for s in ASYM_SCHEMES]
)
def test_encode_equals_the_torch_encoder_bit_for_bit(dtype, scheme, bits, group, symmetric):
    w = _weight(0, 48, 256, DTYPES[dtype])
    parsed = parse_scheme(scheme)
    reference = encode("m.weight", w, parsed)
    got = _native_encode(w, dtype, bits, group or 256, symmetric)
    assert torch.equal(torch.frombuffer(got.packed, dtype=torch.int32).reshape(48, -1), reference["m.weight_packed"])
    assert bytes(got.scale) == bytes(_bytes(reference["m.weight_scale"]))
    if symmetric:
        assert got.zero_point is None and "m.weight_zero_point" not in reference
    else:  # int32 words along the rows, as the package packs them
        assert bytes(got.zero_point) == bytes(_bytes(reference["m.weight_zero_point"]))
    # the error measures are ErrorStats' of qtool's own read-back of the encoded tensors:
    # float64 terms and sums both, so they differ only in the order of the float64 additions
    reconstructed = CompressedTensors().reconstruct("m.weight", reference, parsed, (48, 256), dtype)
    expected = ErrorStats().update(w, reconstructed)
    assert got.errors is not None and got.errors.count == expected.count
    assert got.errors.max_abs == expected.max_abs
    for field in ("signal", "noise", "dot", "recon"):
        assert getattr(got.errors, field) == pytest.approx(getattr(expected, field), rel=1e-12, abs=1e-300)
    for out in DTYPES if bits != 3 else ():  # and back
        decoded = native.decode_int(
            got.packed, got.scale, got.zero_point, dtype, dtype, out, 48, 256, group or 256, bits
        )
        assert bytes(decoded) == bytes(_bytes(reconstructed.to(DTYPES[out]))), out


@pytest.mark.parametrize("logical", DTYPES)
@pytest.mark.parametrize("out", DTYPES)
@pytest.mark.parametrize("scheme,bits,group", SCHEMES[:4])
def test_decode_equals_the_torch_decoder_bit_for_bit(logical, out, scheme, bits, group):
    w = _weight(1, 40, 128, DTYPES[logical])
    parsed = parse_scheme(scheme)
    encoded = encode("m.weight", w, parsed)
    expected = CompressedTensors().reconstruct("m.weight", encoded, parsed, (40, 128), logical).to(DTYPES[out])
    got = native.decode_int(
        _bytes(encoded["m.weight_packed"]),
        _bytes(encoded["m.weight_scale"]),
        None,
        logical,
        logical,
        out,
        40,
        128,
        group or 128,
        bits,
    )
    assert torch.equal(
        torch.frombuffer(got, dtype=DTYPES[out]).reshape(40, 128).view(torch.uint8), expected.view(torch.uint8)
    )


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 40),
    groups=st.integers(1, 6),
    dtype=st.sampled_from(list(DTYPES)),
    which=st.integers(0, 8),
    exponent=st.integers(-30, 30),
    shift=st.floats(-3, 3),
)
def test_encode_matches_torch_on_random_weights(seed, rows, groups, dtype, which, exponent, shift):
    scheme, bits, group = (SCHEMES[:4] + ASYM_SCHEMES)[which]  # which 8: int3 asym
    symmetric = which < 4
    cols = groups * (group or 32)
    g = torch.Generator().manual_seed(seed)
    w = ((torch.randn(rows, cols, generator=g) + shift) * 2.0**exponent).to(DTYPES[dtype])
    got = _native_encode(w, dtype, bits, group or cols, symmetric)
    if not torch.isfinite(w).all():  # float16 overflows at 2^16: torch's semantics, torch's job
        assert got.errors is None
        return
    reference = encode("m.weight", w, parse_scheme(scheme))
    assert torch.equal(torch.frombuffer(got.packed, dtype=torch.int32).reshape(rows, -1), reference["m.weight_packed"])
    assert bytes(got.scale) == bytes(_bytes(reference["m.weight_scale"]))
    if not symmetric:
        assert bytes(got.zero_point) == bytes(_bytes(reference["m.weight_zero_point"]))


def test_threads_split_rows_without_changing_a_bit():
    w = _weight(2, 300, 512, torch.bfloat16)
    native.set_threads(1)
    one = _native_encode(w, "BF16", 4, 128)
    native.set_threads(3)
    try:
        three = _native_encode(w, "BF16", 4, 128)
    finally:
        native.set_threads(None)
    assert one.packed == three.packed and one.scale == three.scale
    assert one.errors.max_abs == three.errors.max_abs
    assert one.errors.noise == pytest.approx(three.errors.noise, rel=1e-12)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_weights_are_left_to_torch(bad):
    w = _weight(3, 16, 64, torch.bfloat16)
    w[5, 7] = bad
    assert _native_encode(w, "BF16", 8, 64).errors is None


def test_bad_layouts_and_short_buffers_are_value_errors():
    from qtool.native import _kernels

    src = bytes(4 * 64 * 2)
    with pytest.raises(ValueError, match="2, 3, 4 or 8 bits"):
        _kernels.encode_int(src, 2, 64, 64, bytearray(256), bytearray(8), None, 5, 0, 4)
    with pytest.raises(ValueError, match="2, 4 or 8 bits"):  # int3 decodes through torch
        _kernels.decode_int(bytes(96), bytes(8), 2, None, 2, bytearray(512), 2, 64, 64, 3, 4, 0, 4)
    with pytest.raises(ValueError, match="src holds"):
        _kernels.encode_int(src, 2, 64, 64, bytearray(256), bytearray(8), None, 8, 0, 5)
    with pytest.raises(ValueError, match="bad layout"):
        _kernels.encode_int(src, 2, 64, 48, bytearray(256), bytearray(8), None, 8, 0, 4)
    with pytest.raises(ValueError, match="unknown dtype"):
        _kernels.decode_int(bytes(256), bytes(8), 7, None, 2, bytearray(512), 2, 64, 64, 8, 4, 0, 4)
    with pytest.raises(ValueError, match="out holds"):
        _kernels.decode_int(bytes(256), bytes(8), 2, None, 2, bytearray(100), 2, 64, 64, 8, 4, 0, 4)


def test_hostile_sizes_are_refused_before_any_access():
    """Sizes whose products overflow Py_ssize_t used to wrap to small numbers that passed the
    buffer checks (pack_zero_points then read far past its input)."""
    from qtool.native import _kernels

    huge = 1 << 62
    calls = [
        (
            "bad layout",
            lambda: _kernels.encode_int(bytes(256), 2, huge, huge, bytearray(64), bytearray(64), None, 8, 0, 4),
        ),
        (
            "src: the size asked for overflows",
            lambda: _kernels.encode_int(bytes(256), 2, 64, 64, bytearray(64), bytearray(64), None, 8, huge - 1, huge),
        ),
        (
            "packed: the size asked for overflows",
            lambda: _kernels.decode_int(
                bytes(64), bytes(64), 2, None, 2, bytearray(64), 2, 64, 64, 8, huge, huge - 1, huge
            ),
        ),
        (
            "zero_point: the size asked for overflows",
            lambda: _kernels.decode_int(
                bytes(256), bytes(8), 2, bytes(64), 2, bytearray(512), 2, 64, 64, 8, (1 << 63) - 1, 0, 4
            ),
        ),
        (
            "zero_point: the size asked for overflows",
            lambda: _kernels.pack_zero_points(bytes(64), huge, 4, 8, bytearray(64)),
        ),
        (
            "zero_point holds 64 bytes, needs 9223372036854775807",
            lambda: _kernels.pack_zero_points(bytes(64), (1 << 63) - 1, 1, 8, bytearray(64)),
        ),
    ]
    for message, call in calls:
        with pytest.raises(ValueError, match=message):
            call()


# -- the pipeline -------------------------------------------------------------------------------


def _qtool(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "qtool", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )


@pytest.mark.parametrize(
    "scheme", ["int8", "W4A16", "int2:g64", "W4A16_ASYM", "int8:asym", "int3:g64:asym", "int3:g64:asym:mse"]
)
def test_native_and_torch_pipelines_write_the_same_bytes(tmp_path, scheme):
    model = SAMPLES / "tiny-llama"
    for name, env in (("native", {}), ("torch", {"QTOOL_NATIVE": "0"})):
        result = _qtool("quantize", str(model), "-o", str(tmp_path / name), "--scheme", scheme, "-q", env=env)
        assert result.returncode == 0, result.stderr
        result = _qtool("dequantize", str(tmp_path / name), "-o", str(tmp_path / f"{name}.safetensors"), "-q", env=env)
        assert result.returncode == 0, result.stderr
    assert (tmp_path / "native" / "model.safetensors").read_bytes() == (
        tmp_path / "torch" / "model.safetensors"
    ).read_bytes()
    assert (tmp_path / "native.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()


def test_an_infinite_weight_falls_back_to_torch_in_the_pipeline(tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(SAMPLES / "tiny-llama" / "model.safetensors")
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[name][3, 5] = float("inf")
    save_file(tensors, tmp_path / "in.safetensors")
    for out, env in (("native", {}), ("torch", {"QTOOL_NATIVE": "0"})):
        result = _qtool(
            "quantize", str(tmp_path / "in.safetensors"), "-o", str(tmp_path / out), "--scheme", "int8", "-q", env=env
        )
        assert result.returncode == 0, result.stderr
    assert (tmp_path / "native" / "model.safetensors").read_bytes() == (
        tmp_path / "torch" / "model.safetensors"
    ).read_bytes()


_NO_TORCH = """
import sys
from qtool.cli import main
sys.argv = ["qtool", *sys.argv[1:]]
try:
    main()
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
assert "torch" not in sys.modules, "torch was imported"
"""


@pytest.mark.parametrize("scheme", ["W4A16", "int8", "int2:g64", "W4A16_ASYM", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_quantize_and_dequantize_of_common_layouts_never_import_torch(tmp_path, scheme):
    """The native kernels did all the work: a torch fallback would have imported torch. GGUF
    outputs also cast the norms to F32 and permute q/k rows, in numpy."""
    model = SAMPLES / "tiny-llama"
    out = tmp_path / ("q.gguf" if scheme.startswith("q") else "q")
    steps = [
        ["quantize", str(model), "-o", str(out), "--scheme", scheme, "-q", "--threads", "1"],
        ["dequantize", str(out), "-o", str(tmp_path / "back.safetensors"), "-q"],
    ]
    for step in steps:
        result = subprocess.run([sys.executable, "-c", _NO_TORCH, *step], capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 0, result.stderr


def test_threads_reach_torch_when_a_job_needs_it(tmp_path):
    """--threads without torch imported sets OMP_NUM_THREADS, which torch reads when a job
    (here FP8, which has no native kernel) imports it."""
    code = _NO_TORCH.replace(
        'assert "torch" not in sys.modules, "torch was imported"',
        "import torch; assert torch.get_num_threads() == 1, torch.get_num_threads()",
    )
    step = [
        "quantize",
        str(SAMPLES / "tiny-llama"),
        "-o",
        str(tmp_path / "q"),
        "--scheme",
        "FP8",
        "-q",
        "--threads",
        "1",
    ]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-c", code, *step], capture_output=True, text=True, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr


def test_files_written_by_compressed_tensors_dequantize_the_same_on_both_paths(tmp_path, monkeypatch):
    """Every fixture the real package wrote: the native decoders take the ones they can (at
    least W4A16 and W8A16) and the output file is byte for byte the torch path's."""
    from qtool import api
    from qtool.conventions import resolve
    from qtool.formats import open_checkpoint

    from .conftest import CT_FIXTURES

    taken = set()
    for fixture in sorted(p for p in CT_FIXTURES.iterdir() if p.is_dir()):
        monkeypatch.delenv("QTOOL_NATIVE", raising=False)
        weights = resolve(open_checkpoint(str(fixture)))
        if any(w.quantized and native_decoders.decoder(w, "BF16") is not None for w in weights):
            taken.add(fixture.name)
        api.dequantize(str(fixture), str(tmp_path / f"{fixture.name}-native.safetensors"))
        monkeypatch.setenv("QTOOL_NATIVE", "0")
        api.dequantize(str(fixture), str(tmp_path / f"{fixture.name}-torch.safetensors"))
        native, reference = (tmp_path / f"{fixture.name}-{k}.safetensors" for k in ("native", "torch"))
        assert native.read_bytes() == reference.read_bytes(), fixture.name
    assert {"W4A16", "W8A16", "W4A16_ASYM"} <= taken, taken


def test_set_threads_never_shuts_the_pool_under_a_running_job():
    """A library caller may change the thread count while another thread encodes."""
    import threading

    w = _weight(3, 64, 256, torch.bfloat16)  # small jobs split over the pool: many submissions
    expected = bytes(_native_encode(w, "BF16", 4, 128).packed)
    failures: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(800):
                assert bytes(_native_encode(w, "BF16", 4, 128).packed) == expected
        except BaseException as exc:
            failures.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    try:
        while worker.is_alive():
            for count in (2, 3, 4):
                native.set_threads(count)
    finally:
        worker.join()
        native.set_threads(None)
    assert failures == []


def test_the_issue_10_calls_raise_in_a_child_not_segfault():
    """issue 10's reproductions, verbatim, in a child process, so a segfault fails this test
    instead of killing the run: every entry point checks its sizes with checked multiplies."""
    code = textwrap.dedent(
        """
        from qtool.native import _kernels as k
        H = 1 << 62
        calls = [
            lambda: k.pack_zero_points(b'', 1 << 33, 1 << 31, 8, bytearray(0)),
            lambda: k.pack_zero_points(b'', 1 << 31, 1 << 33, 4, bytearray(0)),
            lambda: k.encode_int(bytes(256), 2, 64, 64, bytearray(256), bytearray(8), None, 8, 0, H),
            lambda: k.encode_int(bytes(256), 2, 64, 64, bytearray(256), bytearray(8), bytearray(8), 8, H, H + 4),
            lambda: k.decode_int(bytes(64), bytes(64), 2, None, 2, bytearray(64), 2, 64, 64, 8, 4, 0, H),
            lambda: k.decode_gguf("Q8_0", b"", bytearray(0), 0, 0, H),
            lambda: k.decode_gguf("Q8_0", bytes(34), bytearray(0), 0, H, H + 1),
            lambda: k.encode_gguf("Q8_0", b"", 0, H, bytearray(0), 0, H),
        ]
        for call in calls:
            try:
                call()
            except ValueError:
                continue
            raise SystemExit("no ValueError")
        print("all refused")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0 and result.stdout.strip() == "all refused", (
        result.returncode,
        result.stdout,
        result.stderr[-2000:],
    )


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["F32", "F16", "BF16"]),
    st.integers(0, 3 * native.SUM_SLICE + 5),
    st.integers(0, 2**32 - 1),
    st.floats(-30, 30),
)
def test_sum_squares_is_the_signal_numpy_measures_and_needs_no_thread_count(dtype, count, seed, exponent):
    """The signal of a weight copied unchanged (pipeline.kept_error): equal to
    ErrorStats.update_numpy's to far below the 9 digits a report keeps, within rounding of
    the exact sum, and the same bits on 1 thread and on 4."""
    import math

    import numpy as np

    from qtool.float_casts import to_float32

    torch_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype]
    values = (
        torch.randn(count, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2.0**exponent
    ).to(torch_dtype)
    raw = values.view(torch.uint8).numpy().tobytes() if count else b""
    previous = native.threads()
    try:
        native.set_threads(1)
        one = native.sum_squares(raw, dtype, count)
        native.set_threads(4)
        four = native.sum_squares(raw, dtype, count)
    finally:
        native.set_threads(previous)
    x = to_float32(raw, dtype)
    assert one == four
    assert one == pytest.approx(ErrorStats().update_numpy(x, x).signal, rel=1e-13, abs=0)
    assert one == pytest.approx(math.fsum(float(v) * float(v) for v in x.astype(np.float64)), rel=1e-13, abs=0)


def test_sum_squares_refuses_short_buffers_and_bad_ranges():
    out = bytearray(16)
    with pytest.raises(ValueError):
        native._kernels.sum_squares(b"\0" * 8, 0, 3, 2, out, 0, 2)  # 3 F32 values need 12 bytes
    with pytest.raises(ValueError):
        native._kernels.sum_squares(b"\0" * 12, 0, 3, 2, out, 0, 3)  # 3 values by 2: 2 slices
    with pytest.raises(ValueError):
        native._kernels.sum_squares(b"\0" * 12, 0, 3, 2, bytearray(8), 0, 2)  # out holds 1 double


_NO_NUMPY = _NO_TORCH.replace(
    'assert "torch" not in sys.modules, "torch was imported"',
    'assert not {"torch", "numpy"} & set(sys.modules), "torch or numpy was imported"',
)


def test_requantizing_a_gguf_imports_neither_torch_nor_numpy(tmp_path):
    """Issue 18 #14: a GGUF requantize decodes and encodes natively and measures the tensors it
    copies (the F32 norms) natively too; importing numpy for them was a fifth of the run."""
    q4_1 = tmp_path / "q4_1.gguf"
    result = _qtool("quantize", str(SAMPLES / "tiny-llama"), "-o", str(q4_1), "--scheme", "q4_1", "-q")
    assert result.returncode == 0, result.stderr
    for mix in ("Q8_0", "Q4_K_M"):
        step = [
            "quantize",
            str(q4_1),
            "-o",
            str(tmp_path / f"{mix}.gguf"),
            "--scheme",
            mix,
            "--allow-requantize",
            "-q",
            "--threads",
            "2",
        ]
        result = subprocess.run([sys.executable, "-c", _NO_NUMPY, *step], capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 0, result.stderr
