"""What an evaluation returns: the `--json` document of `qtool eval` (and the `outputs` part of
`compare --text`'s), and the gates CI sets on it.

    perplexity, base.perplexity, ppl_ratio     exp(mean loss) over the scored tokens
    kld.{mean, median, p90, p99, p99_9, max}   per-token KL(base || candidate), null without a base
    kld_histogram[]                            {from, to, tokens}: the per-token KL in decades
    top1_agreement                             share of tokens whose most likely next token agrees
    layers[].hidden_error                      sum (h_cand - h_base)^2 / sum h_base^2 after each layer

A figure that was not measured is null, never 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qtool.errors import UsageError

if TYPE_CHECKING:
    from qtool.evaluation.scores import Scores
    from qtool.evaluation.windows import Windows

__all__ = ["OutputGates", "eval_document"]


@dataclass(frozen=True)
class OutputGates:
    """CI's limits on the outputs; each needs a base to compare with."""

    max_kld: float | None = None  # mean KL divergence
    min_top1: float | None = None  # top-1 agreement, 0..1
    max_ppl_ratio: float | None = None  # candidate's perplexity / base's

    @property
    def any_set(self) -> bool:
        return any(v is not None for v in (self.max_kld, self.min_top1, self.max_ppl_ratio))

    def check(self) -> None:
        for name, value in (("max_kld", self.max_kld), ("max_ppl_ratio", self.max_ppl_ratio)):
            if value is not None and not value >= 0:
                raise UsageError(f"{name} {value} must be at least 0", option=name)
        if self.min_top1 is not None and not 0 <= self.min_top1 <= 1:
            raise UsageError(f"min_top1 {self.min_top1} must be from 0 to 1", option="min_top1")

    def to_json(self) -> dict[str, float | None]:
        return {"max_kld": self.max_kld, "min_top1": self.min_top1, "max_ppl_ratio": self.max_ppl_ratio}

    def violations(self, document: dict[str, Any]) -> list[str]:
        """One line per limit the document breaks."""
        found = []
        kld = (document.get("kld") or {}).get("mean")
        if self.max_kld is not None and kld is not None and kld > self.max_kld:
            found.append(f"mean KL divergence {kld:.6f} is above the limit {self.max_kld}")
        top1 = document.get("top1_agreement")
        if self.min_top1 is not None and top1 is not None and top1 < self.min_top1:
            found.append(f"top-1 agreement {top1:.4f} is below the limit {self.min_top1}")
        ratio = document.get("ppl_ratio")
        if self.max_ppl_ratio is not None and ratio is not None and ratio > self.max_ppl_ratio:
            found.append(f"perplexity ratio {ratio:.4f} is above the limit {self.max_ppl_ratio}")
        return found


def eval_document(
    *,
    model: str,
    base: str | None,
    text: str,
    windows: Windows,
    scores: Scores,
    layer_sums: list[tuple[float, float]],
    device: str,
    dtype: str,
    seconds: float,
    gates: OutputGates,
    warnings: list[str],
) -> dict[str, Any]:
    """The `--json` document of one evaluation."""
    perplexity = scores.perplexity()
    base_perplexity = scores.base_perplexity()
    document: dict[str, Any] = {
        "model": model,
        "text": text,
        "ctx": windows.ctx,
        "windows": scores.windows,
        "tokens_scored": scores.tokens,
        "bos": windows.bos,
        "perplexity": perplexity,
        "base": None if base is None else {"path": base, "perplexity": base_perplexity},
        "ppl_ratio": None if base_perplexity is None else perplexity / base_perplexity,
        "kld": scores.kld_summary(),
        "kld_histogram": scores.kld_histogram(),
        "top1_agreement": scores.top1_agreement(),
        "layers": [
            {"index": index, "hidden_error": (error / total if total else 0.0) if base is not None else None}
            for index, (error, total) in enumerate(layer_sums)
        ],
        "device": device,
        "dtype": dtype,
        "seconds": seconds,
        "gates": gates.to_json(),
        "warnings": warnings,
    }
    document["violations"] = gates.violations(document)
    document["ok"] = not document["violations"]
    return document
