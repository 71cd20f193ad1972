"""Error measures between a weight and its quantized reconstruction.

    SQNR (dB)      10 * log10(sum x^2 / sum (x - x_hat)^2)       inf when the error is zero
    relative RMSE  sqrt(sum (x - x_hat)^2 / sum x^2)
    max abs error  max |x - x_hat|
    cosine         sum x * x_hat / sqrt(sum x^2 * sum x_hat^2)

One definition for every path that reports these figures (`qtool quantize`'s torch and native
kernels, `qtool compare`), so a threshold copied from one passes in the other:

- x_hat is the reconstruction *as decoded from the written file*: the value rounded to the
  weight's logical dtype (bf16 for a bf16 weight), not a float32 intermediate.
- Each term is formed in float64: x, x_hat and e = x - x_hat are float64, so x^2 is exact for
  every 16- and 32-bit float, and e is exact whenever x_hat is within a factor 2 of x.
- The terms add up in float64. Paths differ only in the order of the float64 additions:
  measured 1e-14 apart at most on 8M-element weights, far below the 9 significant digits that
  `to_json` keeps, so the reported digits agree, unless a figure falls within that distance of
  a 9-digit rounding boundary (about one figure in 10^5).

x.y and y.y follow from x.x, x.e and e.e (y = x - e), so three sums are kept. A weight can be
measured chunk by chunk, on its device; a model-wide figure is the same sums over every weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ErrorStats", "SIGNIFICANT_DIGITS", "count_non_finite"]

SIGNIFICANT_DIGITS = 9  # what reports and gates see
# Elements per float64 slice. On the CPU: no more than torch's intra-op grain size (32768), so
# the widening copies run inline on the calling thread, and the sums are numpy einsum loops
# (SIMD, one thread). torch.dot would call MKL's ddot, which forks threads even for 16K
# elements; on a busy machine every fork waits for a descheduled worker (measured here: a
# 16M-element pair took 0.2-1.3 s on two threads against 25-45 ms on one). On an accelerator:
# fewer, larger ops.
_CPU_SLICE = 1 << 15
_DEVICE_SLICE = 1 << 22


@dataclass
class ErrorStats:
    signal: float = 0.0  # sum x^2
    noise: float = 0.0  # sum (x - x_hat)^2
    recon: float = 0.0  # sum x_hat^2
    dot: float = 0.0  # sum x * x_hat
    max_abs: float = 0.0
    count: int = 0

    @classmethod
    def from_sums(cls, xx: float, xe: float, ee: float, max_abs: float, count: int) -> ErrorStats:
        """From sum x^2, sum x*e and sum e^2 (e = x - x_hat), as every path accumulates them."""
        return cls(signal=xx, noise=ee, recon=xx - 2 * xe + ee, dot=xx - xe, max_abs=max_abs, count=count)

    def update(self, original, reconstructed) -> ErrorStats:
        """Add one chunk: torch tensors with the same number of elements, any float dtype, any
        device. `reconstructed` should be in the dtype the weight decodes to (see above).

        Per slice of the flat chunk: widen both sides to float64, e = x - x_hat, then sum x*x,
        x*e and e*e and take max |e|; the slice sums add up in a Python float (float64).
        """
        import torch

        x = original.reshape(-1)
        y = reconstructed.reshape(-1)
        if x.numel() != y.numel():
            raise ValueError(f"ErrorStats.update: {x.numel()} original values against {y.numel()} reconstructed")
        total = x.numel()
        on_cpu = x.device.type == "cpu"
        step = _CPU_SLICE if on_cpu else _DEVICE_SLICE
        x_buffer = torch.empty(min(total, step), dtype=torch.float64, device=x.device)
        e_buffer = torch.empty(min(total, step), dtype=torch.float64, device=x.device)
        sums = _cpu_sums if on_cpu else _device_sums
        xx = xe = ee = 0.0
        max_abs = self.max_abs
        for start in range(0, total, step):
            count = min(step, total - start)
            xs, es = x_buffer[:count], e_buffer[:count]
            xs.copy_(x[start : start + count])
            es.copy_(y[start : start + count])
            torch.sub(xs, es, out=es)
            part_xx, part_xe, part_ee, high, low = sums(xs, es)
            xx, xe, ee = xx + part_xx, xe + part_xe, ee + part_ee
            max_abs = max(max_abs, high, -low)
        part = ErrorStats.from_sums(xx, xe, ee, max_abs, total)
        self.signal += part.signal
        self.noise += part.noise
        self.dot += part.dot
        self.recon += part.recon
        self.max_abs = max_abs
        self.count += total
        return self

    def update_numpy(self, original, reconstructed) -> ErrorStats:
        """`update` for numpy arrays on the CPU (the torch-free paths): the same float64 terms,
        the same slices and sums, so the same digits."""
        import numpy as np

        same = reconstructed is original
        x, y = np.ravel(original), np.ravel(reconstructed)
        if same:  # a copy: no error, so only sum x^2, slice by slice as below
            xx = 0.0
            for start in range(0, x.size, _CPU_SLICE):
                xs = x[start : start + _CPU_SLICE].astype(np.float64)
                xx += float(np.einsum("i,i->", xs, xs))
            part = ErrorStats.from_sums(xx, 0.0, 0.0, 0.0, x.size)
            self.signal, self.dot, self.recon, self.count = (
                self.signal + xx,
                self.dot + part.dot,
                self.recon + part.recon,
                self.count + x.size,
            )
            return self
        if x.size != y.size:
            raise ValueError(f"ErrorStats.update_numpy: {x.size} original values against {y.size} reconstructed")
        xx = xe = ee = 0.0
        max_abs = self.max_abs
        for start in range(0, x.size, _CPU_SLICE):
            xs = x[start : start + _CPU_SLICE].astype(np.float64)
            with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN: the sums say so, no numpy warning
                es = xs - y[start : start + _CPU_SLICE].astype(np.float64)
                part_xx, part_xe, part_ee, high, low = _cpu_sums(xs, es)
            xx, xe, ee = xx + part_xx, xe + part_xe, ee + part_ee
            max_abs = max(max_abs, high, -low)
        part = ErrorStats.from_sums(xx, xe, ee, max_abs, x.size)
        self.signal += part.signal
        self.noise += part.noise
        self.dot += part.dot
        self.recon += part.recon
        self.max_abs = max_abs
        self.count += x.size
        return self

    def merge(self, other: ErrorStats) -> ErrorStats:
        return ErrorStats(
            self.signal + other.signal,
            self.noise + other.noise,
            self.recon + other.recon,
            self.dot + other.dot,
            max(self.max_abs, other.max_abs),
            self.count + other.count,
        )

    @property
    def sqnr_db(self) -> float:
        """inf for no error; NaN where the sums hold NaN (or inf against inf): no figure, never
        an exception (an infinite noise made log10(0) raise "math domain error": exit 70)."""
        if math.isnan(self.signal) or math.isnan(self.noise):
            return math.nan
        if self.noise == 0:
            return math.inf
        ratio = self.signal / self.noise
        if math.isnan(ratio):  # inf / inf
            return math.nan
        if ratio == 0:  # no signal, or an infinite noise
            return -math.inf
        if math.isinf(ratio):
            return math.inf
        return 10 * math.log10(ratio)

    @property
    def rel_rmse(self) -> float:
        if self.signal == 0:
            return 0.0 if self.noise == 0 else math.inf
        return math.sqrt(self.noise / self.signal)

    @property
    def cosine(self) -> float:
        product = self.signal * self.recon
        if math.isnan(product):  # NaN sums: no figure
            return math.nan
        denominator = math.sqrt(max(product, 0.0))  # sum x_hat^2 is formed from differences: it may round below 0
        if denominator == 0:
            return 1.0 if self.signal == self.recon else 0.0
        return self.dot / denominator

    def to_json(self) -> dict[str, float | None]:
        def finite(value: float) -> float | None:  # JSON has no inf; null means "no error at all"
            return None if math.isinf(value) or math.isnan(value) else float(f"{value:.{SIGNIFICANT_DIGITS}g}")

        return {
            "sqnr_db": finite(self.sqnr_db),
            "rel_rmse": finite(self.rel_rmse),
            "max_abs_err": finite(self.max_abs),
            "cosine": finite(self.cosine),
        }


def _cpu_sums(xs, es) -> tuple[float, float, float, float, float]:
    """sum x*x, x*e, e*e, max e, min e of two float64 CPU slices (torch or numpy), on the
    calling thread."""
    import numpy as np

    x, e = np.asarray(xs), np.asarray(es)
    return (
        float(np.einsum("i,i->", x, x)),
        float(np.einsum("i,i->", x, e)),
        float(np.einsum("i,i->", e, e)),
        float(e.max()),
        float(e.min()),
    )


def _device_sums(xs, es) -> tuple[float, float, float, float, float]:
    """The same on an accelerator, with torch ops."""
    import torch

    return (
        float(torch.dot(xs, xs)),
        float(torch.dot(xs, es)),
        float(torch.dot(es, es)),
        float(es.amax()),
        float(es.amin()),
    )


NON_FINITE_CHUNK = 4 << 20  # elements per chunk when counting NaN and Inf


# (unsigned view, exponent mask, mantissa mask) of the floats a decoder writes: a value is
# non-finite when its exponent bits are all ones, NaN when its mantissa is not zero
_FLOAT_BITS = {"F32": ("<u4", 0x7F800000, 0x007FFFFF), "F16": ("<u2", 0x7C00, 0x03FF), "BF16": ("<u2", 0x7F80, 0x007F)}


def count_non_finite_bytes(data, dtype: str) -> tuple[int, int] | None:
    """(NaN count, Inf count) of raw little-endian F32/F16/BF16 values from their bit patterns,
    in numpy (a native decode imports no torch); None for any other dtype."""
    if dtype not in _FLOAT_BITS:
        return None
    import numpy as np

    view, exponent, mantissa = _FLOAT_BITS[dtype]
    bits = np.frombuffer(data, dtype=view)
    nan = inf = 0
    for start in range(0, bits.size, NON_FINITE_CHUNK):
        chunk = bits[start : start + NON_FINITE_CHUNK]
        special = chunk[(chunk & exponent) == exponent]
        if special.size:
            nans = int(np.count_nonzero(special & mantissa))
            nan, inf = nan + nans, inf + special.size - nans
    return nan, inf


def count_non_finite(tensor) -> tuple[int, int]:
    """(NaN count, Inf count), chunk by chunk; 0, 0 for integer and bool data."""
    import torch

    flat = tensor.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if not flat.is_floating_point():
        return 0, 0
    nan = inf = 0
    widen = flat.element_size() == 1  # torch has no isinf for its 8-bit floats (Float8_e4m3fn...)
    for start in range(0, flat.numel(), NON_FINITE_CHUNK):
        chunk = flat[start : start + NON_FINITE_CHUNK]
        if widen:
            chunk = chunk.float()
        nan += int(torch.isnan(chunk).sum())
        inf += int(torch.isinf(chunk).sum())
    return nan, inf
