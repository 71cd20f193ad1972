"""Where a weight sits in a transformer, read from its name: the layer index, the expert index
and the projection kind. Reports carry these so a chart can plot error along the depth of a
model without guessing again (`layer`, `kind`, `expert` in the JSON documents).

    name                                                   layer  kind      expert
    model.layers.7.self_attn.q_proj.weight                 7      q         None
    model.layers.7.mlp.down_proj.weight                    7      down      None
    blk.7.ffn_down.weight                  (GGUF)          7      down      None
    encoder.layer.3.attention.self.query.weight  (BERT)    3      q         None
    encoder.layer.3.output.dense.weight          (BERT)    3      down      None
    model.layers.2.mlp.experts.17.up_proj.weight           2      experts   17
    blk.2.ffn_up_exps.weight               (all experts)   2      experts   None
    model.layers.2.mlp.gate.weight         (MoE router)    2      router    None
    model.embed_tokens.weight                              None   embed     None
    lm_head.weight / output.weight                         None   lm_head   None

Kinds: q k v o qkv kv gate up down gate_up experts router norm embed lm_head bias, or None for a
module nothing here recognises. The layer is the first `layers|layer|h|blocks|block|blk|...`
segment followed by a number (the containers gguf-py's `TensorNameMap` knows), so T5's `block.N.layer.M` is layer N. Names come from files:
the parse is one split and one pass over the parts (linear), and a layer or expert index of
more than 9 digits is no index.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WeightPosition", "weight_position", "KINDS", "PROJECTION_KINDS"]

# every kind, in the order a legend shows them
KINDS = (
    "q",
    "k",
    "v",
    "qkv",
    "kv",
    "o",
    "gate",
    "up",
    "gate_up",
    "down",
    "experts",
    "router",
    "norm",
    "embed",
    "lm_head",
    "bias",
)
# the kinds that are linear projections inside a layer: what error along the depth is about
PROJECTION_KINDS = ("q", "k", "v", "qkv", "kv", "o", "gate", "up", "gate_up", "down", "experts", "router")

_LAYER_CONTAINERS = frozenset(
    ("layers", "layer", "h", "blocks", "block", "blk", "decoder_layer", "transformer_encoder")
)
_MAX_INDEX_DIGITS = 9
_PARAMETER_LEAVES = frozenset(("weight", "bias"))

# a module's own name -> kind, wherever it sits
_LEAF_KINDS = {
    # Hugging Face LLaMA-style, Mistral, Qwen, Gemma, Phi-3, DeepSeek
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "qkv_proj": "qkv",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "gate_up_proj": "gate_up",
    "q_a_proj": "q",
    "q_b_proj": "q",
    "kv_a_proj_with_mqa": "kv",
    "kv_b_proj": "kv",
    "out_proj": "o",
    # BERT-style attention, GPT-NeoX, Falcon, GPT-2
    "query": "q",
    "key": "k",
    "value": "v",
    "query_key_value": "qkv",
    "c_attn": "qkv",
    "dense_h_to_4h": "up",
    "dense_4h_to_h": "down",
    "c_fc": "up",
    "fc1": "up",
    "fc2": "down",
    "fc_in": "up",
    "fc_out": "down",
    "q_lin": "q",
    "k_lin": "k",
    "v_lin": "v",
    "out_lin": "o",
    "lin1": "up",
    "lin2": "down",
    # Meta's original LLaMA and Mixtral (w1 gate, w2 down, w3 up); T5's attention
    "wq": "q",
    "wk": "k",
    "wv": "v",
    "w1": "gate",
    "w2": "down",
    "w3": "up",
    "q": "q",
    "k": "k",
    "v": "v",
    # GGUF (llama.cpp's tensor names)
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "attn_qkv": "qkv",
    "attn_q_a": "q",
    "attn_q_b": "q",
    "attn_kv_a_mqa": "kv",
    "attn_kv_b": "kv",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
    "ffn_gate_shexp": "gate",
    "ffn_up_shexp": "up",
    "ffn_down_shexp": "down",
    "ffn_gate_exps": "experts",
    "ffn_up_exps": "experts",
    "ffn_down_exps": "experts",
    "ffn_gate_up_exps": "experts",
    "ffn_gate_inp": "router",
    "router": "router",
    "shared_expert_gate": "router",  # Qwen2-MoE: its shared expert's gate
    # embeddings and heads
    "embed_tokens": "embed",
    "word_embeddings": "embed",
    "position_embeddings": "embed",
    "token_type_embeddings": "embed",
    "wte": "embed",
    "wpe": "embed",
    "tok_embeddings": "embed",
    "token_embd": "embed",
    "embed_positions": "embed",
    "lm_head": "lm_head",
    "output": "lm_head",
    "embed_out": "lm_head",
}
_ATTENTION_PARTS = ("attn", "attention")
_MLP_PARTS = ("mlp", "ffn", "feed_forward", "densereludense", "intermediate")


@dataclass(frozen=True, slots=True)
class WeightPosition:
    layer: int | None  # the transformer block's index, None outside the blocks
    kind: str | None  # one of KINDS, None when the module is not one we recognise
    expert: int | None  # the expert's index inside a mixture, None elsewhere (and for fused experts)

    def to_json(self) -> dict[str, int | str | None]:
        return {"layer": self.layer, "kind": self.kind, "expert": self.expert}


def _index(part: str) -> int | None:
    return int(part) if len(part) <= _MAX_INDEX_DIGITS and part.isdigit() and part.isascii() else None


def weight_position(name: str) -> WeightPosition:
    """The layer, kind and expert of a weight or bias named `name` (any toolchain's names)."""
    parts = name.split(".")
    leaf = None
    if len(parts) > 1 and parts[-1] in _PARAMETER_LEAVES:
        leaf = parts.pop()
    layer = expert = None
    layer_at = -1
    for at in range(len(parts) - 1):
        if parts[at] in _LAYER_CONTAINERS:
            layer = _index(parts[at + 1])
            if layer is not None:
                layer_at = at + 1
                break
    if "experts" in parts[layer_at + 1 :]:
        kind: str | None = "experts"
        at = parts.index("experts", layer_at + 1)
        expert = _index(parts[at + 1]) if at + 1 < len(parts) else None
    else:
        kind = _kind(parts, layer_at + 1)
    if leaf == "bias":
        kind = "bias"
    return WeightPosition(layer, kind, expert)


def _context(parts: list[str], start: int, words: tuple[str, ...]) -> bool:
    """Whether a parent module (after the layer index, before the module itself) names one of `words`."""
    return any(word in part.lower() for part in parts[start:-1] for word in words)


def _kind(parts: list[str], start: int) -> str | None:
    """The kind of the innermost module, read with its parents where its own name is generic."""
    module = parts[-1] if parts else ""
    kind = _LEAF_KINDS.get(module)
    lowered = module if kind is not None else module.lower()
    if kind is None:
        kind = _LEAF_KINDS.get(lowered)
    parent = parts[-2].lower() if len(parts) - 1 > start else None
    if kind is not None:
        return None if kind == "lm_head" and parent is not None else kind  # BERT's `attention.output` is no head
    if lowered in ("wo", "o"):  # Meta LLaMA / T5 attention output; T5's DenseReluDense.wo is the MLP's down
        return "down" if _context(parts, start, _MLP_PARTS) else "o"
    if lowered == "wi" or lowered.startswith("wi_"):  # T5's MLP input(s)
        return "up"
    if lowered == "gate":  # Mixtral's block_sparse_moe.gate, Qwen-MoE's mlp.gate: the router
        return "router"
    if lowered in ("c_proj", "dense"):  # GPT-2's c_proj and GPT-NeoX's dense: attention output or MLP down
        if _context(parts, start, _ATTENTION_PARTS):
            return "o"
        if parent == "intermediate":  # BERT's intermediate.dense
            return "up"
        if parent == "output" or _context(parts, start, _MLP_PARTS):  # BERT's layer-level output.dense
            return "down"
        return None
    if "norm" in lowered or lowered.startswith("ln") or lowered.endswith("_ln"):
        return "norm"
    if "embed" in lowered:
        return "embed"
    return None
