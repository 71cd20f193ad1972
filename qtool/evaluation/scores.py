"""Per scored token: the candidate's loss, and against a base the base's loss, the KL
divergence of the candidate's next-token distribution from the base's, and whether both put
the same token first; summarised as `llama-perplexity --kl-divergence` summarises them.

    perplexity      exp(mean loss)
    KL(base || cand) sum_v p_base(v) (log p_base(v) - log p_cand(v)), in float64 over the whole
                    vocabulary (llama.cpp skips base log-probabilities under -16 and reads the
                    base's from 16-bit values, so its figures differ in the last digits)
    median, p99     llama.cpp's: the middle pair's mean; p-th by linear interpolation at p (n - 1)
    top-1           the share of tokens whose two argmaxes agree

A window's logits are dropped once scored: what stays is a few floats per token.
"""

from __future__ import annotations

import bisect
import math
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Scores", "percentile", "median"]


def median(values: list[float]) -> float:
    """llama.cpp's median of sorted `values`: the middle one, or the mean of the middle two."""
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2] + values[n // 2 - 1])


def percentile(values: list[float], fraction: float) -> float:
    """llama.cpp's percentile of sorted `values`: linear between the two values around
    fraction x (n - 1)."""
    if fraction <= 0:
        return values[0]
    if fraction >= 1:
        return values[-1]
    at = fraction * (len(values) - 1)
    low = int(at)
    part = at - low
    return (1 - part) * values[low] + part * values[min(low + 1, len(values) - 1)]


@dataclass
class Scores:
    """Every scored token's figures, in window order."""

    loss: array = field(default_factory=lambda: array("d"))  # the candidate's -log p(next token)
    base_loss: array = field(default_factory=lambda: array("d"))
    kld: array = field(default_factory=lambda: array("d"))
    same_top: int = 0
    windows: int = 0

    def add(self, targets: torch.Tensor, logits: torch.Tensor, base_logits: torch.Tensor | None) -> None:
        """One window's scored positions: `logits` [n, vocab] of the candidate, `base_logits` of
        the base (or None), `targets` [n] the tokens they predict."""
        import torch

        log_p = torch.log_softmax(logits.double(), dim=-1)
        index = targets.view(-1, 1)
        self.loss.extend((-log_p.gather(1, index)).view(-1).tolist())
        if base_logits is not None:
            base_log_p = torch.log_softmax(base_logits.double(), dim=-1)
            self.base_loss.extend((-base_log_p.gather(1, index)).view(-1).tolist())
            kld = torch.nn.functional.kl_div(log_p, base_log_p, reduction="none", log_target=True).sum(dim=-1)
            self.kld.extend(kld.clamp_min(0.0).tolist())
            self.same_top += int((log_p.argmax(dim=-1) == base_log_p.argmax(dim=-1)).sum())
        self.windows += 1

    @property
    def tokens(self) -> int:
        return len(self.loss)

    def perplexity(self) -> float:
        return math.exp(math.fsum(self.loss) / len(self.loss))

    def base_perplexity(self) -> float | None:
        return math.exp(math.fsum(self.base_loss) / len(self.base_loss)) if self.base_loss else None

    def kld_summary(self) -> dict[str, float] | None:
        """mean, median, p90, p99, p99.9 and max of the per-token KL; None without a base."""
        if not self.kld:
            return None
        ordered = sorted(self.kld)
        return {
            "mean": math.fsum(ordered) / len(ordered),
            "median": median(ordered),
            "p90": percentile(ordered, 0.90),
            "p99": percentile(ordered, 0.99),
            "p99_9": percentile(ordered, 0.999),
            "max": ordered[-1],
        }

    def kld_histogram(self) -> list[dict[str, float | int]] | None:
        """The per-token KL in decades, 1e-6 to 10 (below and above in the end bins): the
        shape of the distribution the HTML report draws; None without a base."""
        if not self.kld:
            return None
        edges = [10.0**power for power in range(-6, 2)]
        counts = [0] * (len(edges) + 1)
        for value in self.kld:
            counts[bisect.bisect_right(edges, value)] += 1
        bounds = [0.0, *edges, math.inf]
        return [
            {"from": bounds[i], "to": None if math.isinf(bounds[i + 1]) else bounds[i + 1], "tokens": count}
            for i, count in enumerate(counts)
        ]

    def top1_agreement(self) -> float | None:
        return self.same_top / len(self.kld) if self.kld else None
