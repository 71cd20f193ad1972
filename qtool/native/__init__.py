"""Fused CPU kernels in C, for the layouts that dominate real runs.

Why they exist: eager torch on the CPU makes one pass over memory per op, and an exact
compressed-tensors encode plus its error measures is ~15 ops per chunk; importing torch alone
costs 2.5-3.5 s on a small machine. These kernels make one pass per row, read and fill plain
buffers (bytes, bytearray, memoryview), and never import torch, so `qtool quantize` and
`qtool dequantize` of the common layouts do not import it either.

Each kernel is bit for bit the torch kernel it stands in for (tests/test_native*.py). The torch
kernels stay the reference, the path for every other layout, and the only path on CUDA. The GGUF
encoders stand in for gguf-py's numpy quantizer instead, byte for byte, since that is what
writes GGUF files in Python (tests/test_native_gguf_encode.py).

The extension is optional (setup.py): where it was not built, `available()` is False and
callers use torch. QTOOL_NATIVE=0 turns it off, to compare the two paths or to debug.

    encode_int      int2/4/8, symmetric or with zero points, per channel or per group, packed
                    as compressed-tensors pack-quantized, with the error sums of
                    qtool.error_measures.ErrorStats
    decode_int      the reverse, to bf16 / f16 / f32
    decode_gguf     GGUF blocks (the types in `gguf_types()`) to bf16 / f16 / f32
    sum_squares     sum x^2 of bf16 / f16 / f32 values in float64: the signal of a weight
                    copied unchanged, for the report, without numpy
    skip_prefixed   the end of u64-length-prefixed strings laid back to back (a GGUF
                    vocabulary's), for the header reader (`qtool.api` hands it to qtool.formats)
    encode_gguf     bf16 / f16 / f32 rows to GGUF blocks (the types in `gguf_encode_types()`),
                    byte for byte gguf.quants.quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, which
                    are llama.cpp's bytes too) or llama.cpp's reference quantizers (Q2_K..Q6_K,
                    IQ4_NL, which gguf-py cannot encode), with the error sums of ErrorStats
    transcode_gguf  encode_gguf of rows held as another GGUF type's blocks, each row decoded as
                    decode_gguf decodes it: a requantize without the weight's float32 copy
    gptq_sweep      GPTQ's column sweep inside one block, row by row (qtool.calibration.gptq),
                    on float32 torch tensors' memory: bit for bit the torch sweep
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from qtool.buffers import HUGE_PAGES_FROM, allocate
from qtool.dtypes import storage_dtype
from qtool.error_measures import ErrorStats
from qtool.errors import KernelError

__all__ = [
    "available",
    "gptq_sweep",
    "encode_int",
    "decode_int",
    "decode_gguf",
    "gguf_types",
    "encode_gguf",
    "transcode_gguf",
    "can_transcode",
    "gguf_encode_types",
    "EncodedBlocks",
    "set_threads",
    "threads",
    "sum_squares",
    "skip_prefixed",
]

try:
    from qtool.native import _kernels
except ImportError:  # not built (no compiler at install time): torch does the work
    _kernels = None

DTYPE_CODES = {"F32": 0, "F16": 1, "BF16": 2}
_MIN_ROWS_PER_TASK = 16  # below this, splitting rows across threads costs more than it saves

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_threads = os.cpu_count() or 1


def available() -> bool:
    return _kernels is not None and os.environ.get("QTOOL_NATIVE", "1") != "0"


def threads() -> int:
    """How many threads the kernels split each call over."""
    return _threads


def set_threads(count: int | None) -> None:
    """Threads for the kernels (default: every CPU). Each call is split into row ranges.

    A job already running keeps the pool it took: the old pool is only told to finish what it
    holds (`shutdown(wait=False)`), never shut under a caller, and the next job starts a new one."""
    global _threads, _pool
    with _lock:
        wanted = count or os.cpu_count() or 1
        if wanted != _threads and _pool is not None:
            _pool.shutdown(wait=False)
            _pool = None
        _threads = wanted


def _split(count: int, unit: int = 1) -> list[tuple[int, int]]:
    """[begin, end) ranges of `count` items, one per thread, each a multiple of `unit`."""
    if count == 0:
        return [(0, 0)]
    parts = max(1, min(_threads, count // max(_MIN_ROWS_PER_TASK, unit)))
    step = -(-count // parts)
    step = -(-step // unit) * unit
    return [(begin, min(count, begin + step)) for begin in range(0, count, step)]


def _run(function, ranges: list[tuple[int, int]], *args) -> list:
    """function(*args, begin, end) over every range, on the pool (the kernels drop the GIL)."""
    global _pool
    if len(ranges) == 1:
        return [function(*args, *ranges[0])]
    with _lock:  # submitted under the lock, so set_threads cannot retire the pool in between
        if _pool is None:
            _pool = ThreadPoolExecutor(_threads, thread_name_prefix="qtool-native")
        futures = [_pool.submit(function, *args, begin, end) for begin, end in ranges]
    return [f.result() for f in futures]


def _filled(nbytes: int) -> memoryview:
    """A buffer for a kernel to fill whole: `allocate`'s for a large one (huge pages), else a
    bytearray left unzeroed (bytearray(n) zeroes it first, for nothing)."""
    if nbytes >= HUGE_PAGES_FROM:
        return allocate(nbytes)
    return memoryview(_kernels.uninitialized(nbytes))


def _memory(tensor):
    """A writable buffer over a contiguous CPU tensor's bytes (no numpy): the tensor must outlive it."""
    import ctypes

    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise KernelError(
            f"native kernels need contiguous CPU tensors, got {tensor.device.type} {'contiguous' if tensor.is_contiguous() else 'strided'}"
        )
    return (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())


def gptq_sweep(w, u, scale, zero_point, gidx, bits: int, codes, errors, col0: int, col1: int) -> None:
    """GPTQ's sweep of columns [col0, col1) of a block, in place: `w` float32 [rows, b] (the
    block, updated), `u` float32 [b, b] (its part of the upper Cholesky factor of H^-1),
    `scale` / `zero_point` (or None) float32 [rows, groups], `gidx` int32 [b] (each column's
    group), `codes` int8 and `errors` float32 [rows, b] filled for those columns. Rows are split
    over the kernels' threads."""
    import torch

    rows, b = w.shape
    for name, tensor, dtype in (
        ("w", w, torch.float32),
        ("u", u, torch.float32),
        ("scale", scale, torch.float32),
        ("gidx", gidx, torch.int32),
        ("codes", codes, torch.int8),
        ("errors", errors, torch.float32),
    ):
        if tensor.dtype != dtype:
            raise KernelError(f"gptq_sweep: {name} is {tensor.dtype}, not {dtype}")
    if zero_point is not None and zero_point.dtype != torch.float32:
        raise KernelError(f"gptq_sweep: zero_point is {zero_point.dtype}, not torch.float32")
    if (
        tuple(u.shape) != (b, b)
        or scale.shape[0] != rows
        or tuple(codes.shape) != (rows, b)
        or tuple(errors.shape) != (rows, b)
        or gidx.numel() != b
    ):
        raise KernelError(
            f"gptq_sweep: shapes disagree: w {list(w.shape)}, u {list(u.shape)}, scale {list(scale.shape)}, codes {list(codes.shape)}, errors {list(errors.shape)}, gidx {gidx.numel()}"
        )
    if zero_point is not None and zero_point.shape != scale.shape:
        raise KernelError(f"gptq_sweep: zero_point {list(zero_point.shape)} and scale {list(scale.shape)} disagree")
    zp = None if zero_point is None else _memory(zero_point)
    buffers = (
        _memory(w),
        _memory(u),
        b,
        _memory(scale),
        zp,
        _memory(gidx),
        scale.shape[1],
        bits,
        _memory(codes),
        _memory(errors),
        col0,
        col1,
    )
    _run(_kernels.gptq_sweep, _split(rows), *buffers)


@dataclass
class Encoded:
    packed: memoryview  # rows x cols*bits/8 bytes: int32 words, LSB-first fields
    scale: memoryview  # rows x cols/group, in the weight's dtype
    zero_point: memoryview | None  # int32 [ceil(rows*bits/32), groups], packed along the rows
    errors: ErrorStats | None  # None when the rows hold inf or NaN: use torch for this weight


def encode_int(
    src, dtype: str, rows: int, cols: int, group: int, bits: int, symmetric: bool = True, observer: str = "minmax"
) -> Encoded:
    """Quantize `rows` rows of `cols` values (row-major `dtype` bytes in `src`); `observer`
    "minmax" or "mse" (qtool.kernels.mse's search, in the same pass)."""
    if observer not in ("minmax", "mse"):
        raise KernelError(f"encode_int: unknown observer {observer!r}")
    groups = cols // group
    packed = allocate(rows * cols * bits // 8)
    scale = allocate(rows * groups * (storage_dtype(dtype).bits // 8))
    zero_point = None if symmetric else allocate(rows * groups)
    kernel = _kernels.encode_int if observer == "minmax" else (lambda *args: _kernels.encode_int(*args, True))
    parts = _run(kernel, _split(rows), src, DTYPE_CODES[dtype], cols, group, packed, scale, zero_point, bits)
    if not all(part[4] for part in parts):
        return Encoded(packed, scale, None, None)
    packed_zero_point = None
    if zero_point is not None:
        packed_zero_point = allocate(-(-rows * bits // 32) * groups * 4)
        _kernels.pack_zero_points(zero_point, rows, groups, bits, packed_zero_point)
    xx, xe, ee = (sum(part[i] for part in parts) for i in range(3))
    errors = ErrorStats(
        signal=xx,
        noise=ee,
        recon=xx - 2 * xe + ee,
        dot=xx - xe,
        max_abs=max(part[3] for part in parts),
        count=rows * cols,
    )
    return Encoded(packed, scale, packed_zero_point, errors)


def decode_int(
    packed,
    scale,
    zero_point,
    scale_dtype: str,
    logical_dtype: str,
    out_dtype: str,
    rows: int,
    cols: int,
    group: int,
    bits: int,
) -> memoryview:
    """out_dtype(logical_dtype((q - zp) * scale)) for every value of an `encode_int` layout;
    `zero_point` None for symmetric codes."""
    out = allocate(rows * cols * (storage_dtype(out_dtype).bits // 8))
    codes = (
        DTYPE_CODES[scale_dtype],
        zero_point,
        DTYPE_CODES[logical_dtype],
        out,
        DTYPE_CODES[out_dtype],
        cols,
        group,
        bits,
        rows,
    )
    _run(_kernels.decode_int, _split(rows), packed, scale, *codes)
    return out


def decode_gguf(type_name: str, src, blocks: int, block_size: int, out_dtype: str) -> memoryview:
    """`blocks` GGUF blocks of `type_name` (raw bytes in `src`) as `out_dtype` values."""
    out = _filled(blocks * block_size * (storage_dtype(out_dtype).bits // 8))
    _run(_kernels.decode_gguf, _split(blocks, 64), type_name, src, out, DTYPE_CODES[out_dtype])
    return out


SUM_SLICE = 1 << 15  # error_measures' slice: the float64 partial sums are added in this order


def skip_prefixed(buf, pos: int, count: int) -> int | None:
    """The offset just past `count` strings from `pos` in `buf`, each a little-endian u64
    length then its bytes; -1 where one runs past the end of `buf`; None without the extension
    (the caller walks them itself), as with an extension built before it had this function."""
    walk = getattr(_kernels, "skip_prefixed", None) if available() else None
    return None if walk is None else walk(buf, pos, count)


def sum_squares(src, dtype: str, count: int) -> float:
    """sum x^2 (float64) over the `count` values of `dtype` in `src`: each slice of SUM_SLICE
    values summed in C, the slice sums added here in order (whatever the thread count)."""
    slices = -(-count // SUM_SLICE)
    out = allocate(slices * 8)
    if slices:
        _run(_kernels.sum_squares, _split(slices), src, DTYPE_CODES[dtype], count, SUM_SLICE, out)
    total = 0.0
    for part in out.cast("d"):
        total += part
    return total


def gguf_types() -> frozenset[str]:
    """The GGML types `decode_gguf` decodes: the entries of the kernel's own table (a
    `qtool.ggml_types` row names its entry, `native_decoder`)."""
    return frozenset(_gguf_decoders())


@dataclass
class EncodedBlocks:
    data: memoryview  # rows x cols/block_size blocks, as gguf.quants.quantize lays out a [rows, cols] array
    # None when the rows hold inf or NaN. Then `data` holds every row's bytes only where the
    # kernel encodes such rows as llama.cpp does: the K-quants and IQ types, and any type but
    # Q8_0 with importance weights (`qtool.ggml_types`: quantizer LLAMA_CPP, `takes_imatrix`).
    # For gguf-py's types without them it is unfinished: encode this weight with gguf-py.
    errors: ErrorStats | None


def encode_gguf(type_name: str, src, dtype: str, rows: int, cols: int, importance=None) -> EncodedBlocks:
    """`rows` rows of `cols` values (row-major `dtype` bytes in `src`) as GGUF `type_name`
    blocks: byte for byte what gguf.quants.quantize makes of them widened to float32 for the
    32-value types, and what llama.cpp's quantize_row_*_ref (quantize_iq4_nl, quantize_iq4_xs
    for IQ4_NL, IQ4_XS) make of them, without an importance matrix, for the K-quants and IQ4.

    `importance`: float32 bytes (or any buffer) of `cols` weights, one per column, the same for
    every row: llama.cpp's `quant_weights`. Then every type but Q8_0 (which llama.cpp quantizes
    without them) takes llama.cpp's weighted path (quantize_<type>(..., quant_weights)), and its
    bytes, rows with inf or NaN included.

    Checked here before anything is allocated (the kernel checks again), so a bad size is a
    KernelError (a ValueError) and never a huge allocation."""
    sizes = _gguf_encoders().get(type_name)
    if sizes is None:
        raise KernelError(f"no native GGUF encoder for {type_name!r} (known: {' '.join(sorted(_gguf_encoders()))})")
    block_size, type_size = sizes
    if dtype not in DTYPE_CODES:
        raise KernelError(f"encode_gguf: dtype {dtype!r} is not one of {' '.join(DTYPE_CODES)}")
    if rows < 0 or cols < 0 or cols % block_size:
        raise KernelError(
            f"encode_gguf: {rows} rows of {cols} values; cols must be a multiple of {block_size} for {type_name}"
        )
    need = rows * cols * (storage_dtype(dtype).bits // 8)
    have = memoryview(src).nbytes
    if have < need:
        raise KernelError(f"encode_gguf src holds {have} bytes, needs {need}")
    if importance is not None and memoryview(importance).nbytes != 4 * cols:
        raise KernelError(
            f"encode_gguf: importance holds {memoryview(importance).nbytes} bytes, needs {4 * cols} (one float32 per column)"
        )
    data = _filled(rows * (cols // block_size) * type_size)  # whole when finite; else not used
    kernel = _kernels.encode_gguf if importance is None else (lambda *args: _kernels.encode_gguf(*args, importance))
    return _encoded_blocks(
        data, rows, cols, _kernel_run(kernel, _split(rows), type_name, src, DTYPE_CODES[dtype], cols, data)
    )


def transcode_gguf(type_name: str, src_type: str, src, rows: int, cols: int, importance=None) -> EncodedBlocks:
    """`encode_gguf` of `rows` rows of `cols` values held as GGUF `src_type` blocks (raw bytes in
    `src`), each row decoded as `decode_gguf` decodes it to float32: the same bytes and error
    sums as decoding the whole weight first, without its float32 copy in memory (4 bytes a
    value written, then read back: a requantize's largest cost). `src_type` one of
    `gguf_types()`, `cols` a multiple of its block size."""
    sizes = _gguf_encoders().get(type_name)
    source = _gguf_sizes(src_type)
    if sizes is None or source is None:
        raise KernelError(f"no native GGUF transcoder from {src_type!r} to {type_name!r}")
    block_size, type_size = sizes
    if rows < 0 or cols < 0 or cols % block_size or cols % source[0]:
        raise KernelError(
            f"transcode_gguf: {rows} rows of {cols} values; cols must be a multiple of {block_size} for {type_name} and of {source[0]} for {src_type}"
        )
    need = rows * (cols // source[0]) * source[1]
    have = memoryview(src).nbytes
    if have < need:
        raise KernelError(f"transcode_gguf src holds {have} bytes, needs {need}")
    if importance is not None and memoryview(importance).nbytes != 4 * cols:
        raise KernelError(
            f"transcode_gguf: importance holds {memoryview(importance).nbytes} bytes, needs {4 * cols} (one float32 per column)"
        )
    data = _filled(rows * (cols // block_size) * type_size)  # whole when finite; else not used
    kernel = (
        _kernels.transcode_gguf if importance is None else (lambda *args: _kernels.transcode_gguf(*args, importance))
    )
    return _encoded_blocks(data, rows, cols, _kernel_run(kernel, _split(rows), type_name, src_type, src, cols, data))


def can_transcode(src_type: str, type_name: str) -> bool:
    """Whether `transcode_gguf` takes GGUF `src_type` blocks to `type_name`."""
    return available() and type_name in _gguf_encoders() and _gguf_sizes(src_type) is not None


def _kernel_run(kernel, ranges: list[tuple[int, int]], *args) -> list:
    """`_run` of an encoder, whose own refusals (a type it makes only with importance weights,
    as llama.cpp's quantizer asserts) are KernelErrors like the checks above."""
    try:
        return _run(kernel, ranges, *args)
    except ValueError as exc:
        raise KernelError(str(exc)) from None


def _encoded_blocks(data, rows: int, cols: int, parts: list) -> EncodedBlocks:
    """The blocks in `data` with the error sums of the kernel's row ranges (`parts`), added in order."""
    if not all(part[4] for part in parts):
        return EncodedBlocks(data, None)
    xx, xe, ee = (sum(part[i] for part in parts) for i in range(3))
    # a scale past float16's range decodes to inf, and inf * 0 to NaN: NaN wins whatever the split
    max_abs = math.nan if any(math.isnan(part[3]) for part in parts) else max(part[3] for part in parts)
    errors = ErrorStats(signal=xx, noise=ee, recon=xx - 2 * xe + ee, dot=xx - xe, max_abs=max_abs, count=rows * cols)
    return EncodedBlocks(data, errors)


_gguf_encoder_sizes: dict[str, tuple[int, int]] | None = None
_gguf_decoder_sizes: dict[str, tuple[int, int]] | None = None


def _gguf_sizes(type_name: str) -> tuple[int, int] | None:
    """(values, bytes) per block of a type `decode_gguf` decodes, else None."""
    return _gguf_decoders().get(type_name)


def _gguf_decoders() -> dict[str, tuple[int, int]]:
    """{type name: (values, bytes) per block}, from the decoder kernel's own table."""
    global _gguf_decoder_sizes
    if _gguf_decoder_sizes is None:
        _gguf_decoder_sizes = _kernels.gguf_decoders() if _kernels is not None else {}
    return _gguf_decoder_sizes


def _gguf_encoders() -> dict[str, tuple[int, int]]:
    """{type name: (values, bytes) per block}, from the kernel's own table."""
    global _gguf_encoder_sizes
    if _gguf_encoder_sizes is None:
        _gguf_encoder_sizes = _kernels.gguf_encoders() if _kernels is not None else {}
    return _gguf_encoder_sizes


def gguf_encode_types() -> frozenset[str]:
    """The GGML types `encode_gguf` encodes."""
    return frozenset(_gguf_encoders())
