"""Report documents of made-up models, built by the real document code (`plan_comparison`,
`Comparison.to_json`, `eval_document`) from made-up weights and error sums, or per-token
scores, without a checkpoint on disk: for the HTML report's tests and
`benchmarks/bench_html.py` (a 1,000-weight model, a 60,000-expert one). Deterministic for a
seed.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from qtool.comparison import Gates, plan_comparison
from qtool.dtypes import storage_dtype
from qtool.error_measures import ErrorStats
from qtool.evaluation.report import OutputGates, eval_document
from qtool.evaluation.scores import Scores
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.weight import Weight

__all__ = ["synthetic_comparison", "synthetic_evaluation", "synthetic_names", "PROJECTIONS"]

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def synthetic_names(layers: int, experts: int = 0) -> list[str]:
    """A LLaMA-shaped model's weight names; with `experts`, each layer's MLP is that many
    experts (gate/up/down each) behind a router instead of one MLP."""
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        names += [prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"]
        if experts:
            names += [prefix + p + ".weight" for p in PROJECTIONS[:4]]
            names.append(prefix + "mlp.gate.weight")
            names += [f"{prefix}mlp.experts.{e}.{p}.weight" for e in range(experts) for p in _EXPERT_PROJECTIONS]
        else:
            names += [prefix + p + ".weight" for p in PROJECTIONS]
    return names


def _weight(name: str, dtype: str, shape: tuple[int, ...], offset: int, scheme=None) -> Weight:
    size = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
    if dtype != "BF16":
        size //= 4
    tensor = StoredTensor(
        name,
        storage_dtype(dtype if dtype == "BF16" else "U8"),
        (size,) if dtype != "BF16" else shape,
        offset,
        offset + size,
        "synthetic.safetensors",
    )
    return Weight(name, shape, "BF16", {"data": tensor}, scheme)


def synthetic_comparison(
    layers: int, experts: int = 0, *, seed: int = 0, b: str = "synthetic-w4/", min_sqnr: float | None = 15.0
) -> dict[str, Any]:
    """The `compare --json` document of a bf16 model against a W4A16 version of it: every
    projection measured (SQNR about 19-22 dB, the last layers' down_proj a few dB worse, one
    expert an outlier), norms and embeddings exact copies."""
    from qtool.scheme_strings import parse_scheme

    scheme = parse_scheme("W4A16")
    rng = random.Random(seed)
    names = synthetic_names(layers, experts)
    weights_a, weights_b = [], []
    offset = 0
    for name in names:
        projection = name.endswith("_proj.weight")
        shape = (
            (256, 256)
            if name.endswith("proj.weight") or "embed" in name or "lm_head" in name or name.endswith("gate.weight")
            else (256,)
        )
        weights_a.append(_weight(name, "BF16", shape, offset))
        weights_b.append(_weight(name, "I4" if projection else "BF16", shape, offset, scheme if projection else None))
        offset += 1 << 17
    comparison = plan_comparison(
        Checkpoint("synthetic/", "safetensors", [], {}), weights_a, Checkpoint(b, "safetensors", [], {}), weights_b
    )
    outlier = (layers // 2, experts // 3) if experts else None
    for pair in comparison.pairs:
        count = pair.a.parameters
        if not pair.name.endswith("_proj.weight"):
            pair.stats = ErrorStats.from_sums(float(count), 0.0, 0.0, 0.0, count)  # an exact copy
            continue
        sqnr = 20.5 + rng.gauss(0, 0.6)
        layer = int(pair.name.split(".")[2])
        if "down_proj" in pair.name and layer >= layers - 3:
            sqnr -= 4.0 + (layer - layers + 3)
        if outlier and f"layers.{outlier[0]}.mlp.experts.{outlier[1]}.down_proj" in pair.name:
            sqnr = 9.5
        noise = count / 10 ** (sqnr / 10)
        pair.stats = ErrorStats.from_sums(float(count), 0.0, noise, 0.02 + rng.random() * 0.01, count)
    return comparison.to_json(Gates(min_sqnr=min_sqnr))


def synthetic_evaluation(
    layers: int = 8,
    *,
    model: str = "synthetic-w4/",
    base: str | None = "synthetic/",
    seed: int = 0,
    windows: int = 4,
    ctx: int = 64,
    gates: OutputGates | None = None,
) -> dict[str, Any]:
    """The `qtool eval --json` document of a W4 model (against `base`, or alone with None) on
    `windows` windows of `ctx` tokens: per-token losses about 5.5 nats, the KL divergence
    spread over several decades around 1e-3, top-1 agreement about 0.9, the hidden-state error
    growing by decades with depth (1e-4 at the first layer)."""
    rng = random.Random(seed)
    scores = Scores(windows=windows)
    tokens = windows * (ctx - 1 - ctx // 2)
    for _ in range(tokens):
        base_loss = 5.5 + rng.gauss(0, 1.0)
        kld = 10 ** rng.gauss(-3, 0.8)
        scores.loss.append(base_loss + kld * 3)
        if base is not None:
            scores.base_loss.append(base_loss)
            scores.kld.append(kld)
            scores.same_top += rng.random() < 0.9
    error = [1e-4 * 10 ** (3 * layer / max(layers - 1, 1)) * (1 + 0.2 * rng.random()) for layer in range(layers)]
    return eval_document(
        model=model,
        base=base,
        text="wiki.test.txt",
        windows=SimpleNamespace(ctx=ctx, bos=1),  # eval_document reads only these of qtool.evaluation.windows.Windows
        scores=scores,
        layer_sums=[(value, 1.0) for value in error],
        device="cpu",
        dtype="float32",
        seconds=1.25,
        gates=gates or OutputGates(),
        warnings=[],
    )
