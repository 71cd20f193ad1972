"""Error measures between a weight and its quantized reconstruction.

Sums are accumulated in float64 so that a weight can be measured chunk by chunk, on its device,
and a model-wide figure is the same accumulation over every weight:

    SQNR (dB)      10 * log10(sum x^2 / sum (x - x_hat)^2)       inf when the error is zero
    relative RMSE  sqrt(sum (x - x_hat)^2 / sum x^2)
    max abs error  max |x - x_hat|
    cosine         sum x * x_hat / sqrt(sum x^2 * sum x_hat^2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ErrorStats"]


@dataclass
class ErrorStats:
    signal: float = 0.0  # sum x^2
    noise: float = 0.0  # sum (x - x_hat)^2
    recon: float = 0.0  # sum x_hat^2
    dot: float = 0.0  # sum x * x_hat
    max_abs: float = 0.0
    count: int = 0

    def update(self, original, reconstructed) -> "ErrorStats":
        """Add one chunk (torch tensors of the same shape, any float dtype, any device)."""
        import torch

        x = original.to(torch.float64)
        y = reconstructed.to(torch.float64)
        error = x - y
        self.signal += float((x * x).sum())
        self.noise += float((error * error).sum())
        self.recon += float((y * y).sum())
        self.dot += float((x * y).sum())
        if error.numel():
            self.max_abs = max(self.max_abs, float(error.abs().max()))
        self.count += x.numel()
        return self

    def merge(self, other: "ErrorStats") -> "ErrorStats":
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
        if self.noise == 0:
            return math.inf
        if self.signal == 0:
            return -math.inf
        return 10 * math.log10(self.signal / self.noise)

    @property
    def rel_rmse(self) -> float:
        if self.signal == 0:
            return 0.0 if self.noise == 0 else math.inf
        return math.sqrt(self.noise / self.signal)

    @property
    def cosine(self) -> float:
        denominator = math.sqrt(self.signal * self.recon)
        if denominator == 0:
            return 1.0 if self.signal == self.recon else 0.0
        return self.dot / denominator

    def to_json(self) -> dict[str, float | None]:
        def finite(value: float) -> float | None:  # JSON has no inf; null means "no error at all"
            return None if math.isinf(value) or math.isnan(value) else float(f"{value:.9g}")

        return {
            "sqnr_db": finite(self.sqnr_db),
            "rel_rmse": finite(self.rel_rmse),
            "max_abs_err": finite(self.max_abs),
            "cosine": finite(self.cosine),
        }
