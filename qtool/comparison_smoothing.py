"""AWQ's smoothing as `qtool compare` sees it: measure a smoothed model against what it encodes.

AWQ (`qtool.calibration.awq`, AutoAWQ, llm-compressor) multiplies the input channels of a group
of Linears by s and divides the op that feeds them by s, so the float model computes the same
function: B stores the codes of W·diag(s) and the norm's weight w / s, and nothing in B records
s. Measured against A's W, those codes read as noise (SmolLM2-135M AWQ int4: model SQNR 4.2 dB,
225 weights under 15 dB, with the perplexity of GPTQ's output). So compare finds s where B
holds it exactly, in a norm stored in float on both sides:

    s = w_A / w_B                  per channel, for a norm that computes x·w (RMSNorm, LayerNorm)
    s = (1 + w_A) / (1 + w_B)      for one that computes x·(1 + w) (Gemma's, `OFFSET_NORMS`)

and measures each Linear that norm feeds (`NORM_FEEDS`: q/k/v, gate/up) against A·diag(s):
A's weight in the basis B's codes live in. A channel where both norms are 0 reads no input
and keeps s = 1. A norm that differs from A's by no positive scale per channel (a sign flips,
one side 0, NaN) is not a smoothing: it is measured as stored.

The norm itself is the scales: it has no error figure (`ROLE_NORM`). Where the scales were
folded into a Linear's rows instead (`LINEAR_FEEDS`: v_proj -> o_proj where grouped-query
attention does not rule it out, up_proj -> down_proj, an expert's up -> down), they sit in a
quantized weight, known only to its rounding: neither the smoothing Linear nor the one it feeds
can be rebuilt from A, so both are checked for shapes and NaN/Inf like any pair but get no
error figures (`ROLE_UNRECOVERED`), with a note; such a model is gated on its outputs. The
Linear-to-Linear pairs are taken as smoothed only in a model whose norms show smoothing, and
only where the shapes allow it and the fed Linear is quantized: where AWQ's mappings
(`qtool.calibration.awq.layer_mappings`) would apply. Names are the Hugging Face ones of the
LLaMA family (after compare's renaming), as the mappings are.

Nothing here reads more than the norms (1-D, as long as the Linears' input) before the pairs
are measured; every loop is linear in the pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable, Iterator, Sequence

from qtool.formats.checkpoint import Checkpoint
from qtool.weight import Weight

if TYPE_CHECKING:
    import torch

__all__ = [
    "ROLE_NORM", "ROLE_RESCALED", "ROLE_UNRECOVERED", "OFFSET_NORMS", "NORM_FEEDS", "LINEAR_FEEDS",
    "Smoothing", "SmoothingFound", "find_smoothing", "rescaled_chunks",
]  # fmt: skip

ROLE_NORM = "norm"  # a smoothed norm: its ratio to A's is the scales; no error figure
ROLE_RESCALED = "rescaled"  # measured against A's columns times a smoothed norm's scales
ROLE_UNRECOVERED = "unrecovered"  # smoothed through a Linear's rows: no error figure

# model_type of the transformers families whose RMSNorm computes x * (1 + w)
OFFSET_NORMS = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_next", "recurrent_gemma", "vaultgemma"})

_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj")
# a decoder layer's norm -> the Linears it feeds (relative names); Gemma 2/3's MLP is fed by
# pre_feedforward_layernorm, their post_attention_layernorm scales the attention's output
NORM_FEEDS = {"input_layernorm": _ATTENTION, "pre_feedforward_layernorm": _MLP, "post_attention_layernorm": _MLP}
# a Linear -> the Linear its output rows feed, where AWQ folds scales into those rows;
# True: a fused qkv_proj, whose last third (v) feeds o_proj
LINEAR_FEEDS = {
    "self_attn.v_proj": ("self_attn.o_proj", False),
    "self_attn.qkv_proj": ("self_attn.o_proj", True),
    "mlp.up_proj": ("mlp.down_proj", False),
    "mlp.gate_up_proj": ("mlp.down_proj", False),
}
_EXPERT_FEEDS = {"up_proj": "down_proj", "w3": "w2"}  # an expert's up -> down (Mixtral's w3 -> w2)
_LAYERS = ".layers."


@dataclass(frozen=True, eq=False)  # eq=False: `scales` is a tensor
class Smoothing:
    """What the smoothing did to one pair. `by`: A's name of the norm whose scales apply
    (rescaled), or of the other Linear of a Linear-to-Linear fold (unrecovered)."""

    role: str
    by: str
    scales: Any = None  # torch.Tensor [in] float64 on the comparison's device, for ROLE_RESCALED
    note: str = ""

    @property
    def measured(self) -> bool:
        return self.role == ROLE_RESCALED

    def to_json(self) -> dict[str, str]:
        return {"role": self.role, "by": self.by}


@dataclass(frozen=True)
class SmoothingFound:
    """The run's smoothing: counts of each role, for the summary and its one line."""

    norms: int = 0
    rescaled: int = 0
    unrecovered: int = 0

    @property
    def any(self) -> bool:
        return bool(self.norms)

    def line(self) -> str | None:
        """One line for the run, or None when B shows no smoothing."""
        if not self.norms:
            return None
        text = (
            f"B is smoothed (AWQ): {self.norms} norms differ from A's by a positive scale per channel; "
            f"{self.rescaled} weights they feed are measured against A's columns times those scales"
        )
        if self.unrecovered:
            text += (
                f"; {self.unrecovered} weights smoothed through a quantized Linear (v_proj -> o_proj, up_proj -> down_proj) "
                "have no weight SQNR, as B does not record those scales: gate this model on its outputs"
            )
        return text

    def to_json(self) -> dict[str, Any] | None:
        if not self.norms:
            return None
        return {"norms": self.norms, "rescaled": self.rescaled, "unrecovered": self.unrecovered, "line": self.line()}


def _split(key: str) -> tuple[str, str] | None:
    """(layer prefix, relative module name) of a decoder layer's `.weight`, or None. Linear in
    the name's length: partitions, no regex."""
    if not key.endswith(".weight"):
        return None
    head, sep, tail = key[: -len(".weight")].rpartition(_LAYERS)
    index, dot, relative = tail.partition(".")
    if not sep or not dot or not index.isdigit() or not relative:
        return None
    return f"{head}{sep}{index}", relative


def _is_plain_float(weight: Weight) -> bool:
    return not weight.quantized and weight.data.dtype.kind == "float" and weight.data.dtype.torch_name is not None


def _float_sides(pair: Any) -> bool:
    """Both sides float: quantized, or plain float data (not an index or a mask)."""
    return all(weight.quantized or _is_plain_float(weight) for weight in (pair.a, pair.b))


def _values(checkpoint: Checkpoint, weight: Weight):
    """A plain 1-D float weight's values, float64 numpy (pread, in chunks)."""
    import numpy as np

    from qtool.plain_values import value_chunks

    parts = [values for values, _ in value_chunks(checkpoint, weight.data, 1 << 16)]
    return np.concatenate(parts) if parts else np.zeros(0)


def _scales(a, b, offset: bool):
    """s per channel, or (None, why) where the two norms differ by no positive scale."""
    import numpy as np

    gain_a, gain_b = (1 + a, 1 + b) if offset else (a, b)
    if not (np.isfinite(gain_a).all() and np.isfinite(gain_b).all()):
        return None, "holds NaN or Inf"
    zero_a, zero_b = gain_a == 0, gain_b == 0
    if (zero_a != zero_b).any():
        return None, "is 0 on a channel where A's is not, or the other way round"
    both = zero_a & zero_b
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scales = np.where(both, 1.0, gain_a / np.where(both, 1.0, gain_b))
    if not (np.isfinite(scales).all() and (scales > 0).all()):
        return None, "changes sign on a channel"
    return scales, None


def _range(scales) -> str:
    return f"{float(scales.min()):.3g} to {float(scales.max()):.3g}"


def find_smoothing(pairs: Sequence[Any], a: Checkpoint, b: Checkpoint, device: str) -> SmoothingFound:
    """Set `pair.smoothing` on each pair the smoothing touched (pairs with a finding are left
    alone) and count them. Reads the decoder layers' norms that changed; nothing else."""
    import torch

    config = b.config or a.config
    model_type = config.get("model_type")
    offset = isinstance(model_type, str) and model_type in OFFSET_NORMS
    layers: dict[str, dict[str, Any]] = {}
    for pair in pairs:
        if pair.finding is not None:
            continue
        split = _split(pair.key)
        if split is not None:
            layers.setdefault(split[0], {})[split[1]] = pair
    norms = 0
    for members in layers.values():
        for norm_name, feeds in NORM_FEEDS.items():
            if norm_name == "post_attention_layernorm" and "pre_feedforward_layernorm" in members:
                continue
            norm = members.get(norm_name)
            if norm is None or len(norm.a.shape) != 1 or not (_is_plain_float(norm.a) and _is_plain_float(norm.b)):
                continue
            width = norm.a.shape[0]
            fed = [
                p
                for p in (members.get(name) for name in feeds)
                if p is not None and len(p.a.shape) == 2 and p.a.shape[1] == width and _float_sides(p)
            ]
            if not fed:
                continue
            values_a, values_b = _values(a, norm.a), _values(b, norm.b)
            if values_a.shape != values_b.shape or (values_a == values_b).all():
                continue
            scales, why = _scales(values_a, values_b, offset)
            if scales is None:
                norm.notes.append(
                    f"differs from A by no positive scale per channel (B's {why}): not AWQ's smoothing; compared as stored"
                )
                continue
            norms += 1
            norm.smoothing = Smoothing(
                ROLE_NORM, norm.name,
                note=f"smoothed (AWQ): B's values are A's divided by a scale per channel ({_range(scales)}{', as 1 + w' if offset else ''}), "
                "the scales the Linears it feeds were multiplied by; no error figure of its own",
            )  # fmt: skip
            tensor = torch.from_numpy(scales).to(device)
            for pair in fed:
                pair.smoothing = Smoothing(
                    ROLE_RESCALED,
                    norm.name,
                    tensor,
                    f"measured against A's columns times the smoothing scales of {norm_name} ({_range(scales)})",
                )
    if norms:
        for members in layers.values():
            for source, target in _linear_folds(members):
                if not _fold_applies(source, target):
                    continue
                for pair, other in ((source, target), (target, source)):
                    pair.smoothing = Smoothing(
                        ROLE_UNRECOVERED, other.name,
                        note=f"not measured: AWQ smooths {_short(source)} -> {_short(target)} with scales kept only in a quantized "
                        "weight, so the weights B encodes cannot be rebuilt from A; gate the model on its outputs",
                    )  # fmt: skip
    roles = [pair.smoothing.role for pair in pairs if pair.smoothing is not None]
    return SmoothingFound(roles.count(ROLE_NORM), roles.count(ROLE_RESCALED), roles.count(ROLE_UNRECOVERED))


def _short(pair: Any) -> str:
    split = _split(pair.key)
    return split[1] if split else pair.key


def _linear_folds(members: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """(smoothing Linear, the Linear its rows feed) of one layer, as named."""
    for relative, pair in members.items():
        feeds = LINEAR_FEEDS.get(relative)
        if feeds is not None:
            target = members.get(feeds[0])
            if target is not None:
                yield pair, target
            continue
        head, dot, leaf = relative.rpartition(".")
        if dot and leaf in _EXPERT_FEEDS and head.rpartition(".")[0].endswith("experts"):
            target = members.get(f"{head}.{_EXPERT_FEEDS[leaf]}")
            if target is not None:
                yield pair, target


def _fold_applies(source: Any, target: Any) -> bool:
    """AWQ's rule (`qtool.calibration.awq.layer_mappings`): the fed Linear is quantized, and the
    smoothing Linear's rows cover its inputs (a fused qkv_proj: three times; grouped-query
    attention's narrower v_proj: no fold)."""
    if (
        len(source.a.shape) != 2
        or len(target.a.shape) != 2
        or not (target.a.quantized or target.b.quantized)
        or not (_float_sides(source) and _float_sides(target))
    ):
        return False
    width = target.a.shape[1]
    fused = LINEAR_FEEDS.get(_short(source), (None, False))[1]
    return source.a.shape[0] == 3 * width if fused else source.a.shape[0] >= width


def rescaled_chunks(chunks: Iterable[torch.Tensor], scales: torch.Tensor) -> Iterator[torch.Tensor]:
    """Flat chunks of a [out, in] weight (row-major) times `scales` [in] along its columns, in
    float64: the chunk starting at element k holds columns k % in, k % in + 1, ..."""
    import torch

    columns = scales.shape[0]
    start = 0
    for chunk in chunks:
        count = chunk.numel()
        index = torch.arange(start, start + count, device=scales.device) % columns
        yield chunk.to(torch.float64) * scales[index]
        start += count
