"""Layer, kind and expert from a weight's name: the examples of the module's table, every block
and head tensor name gguf-py's `TensorNameMap` knows (the real library's own list of how ~100
architectures name their tensors), and hostile names."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.weight_position import KINDS, WeightPosition, weight_position

EXAMPLES = [
    ("model.layers.7.self_attn.q_proj.weight", 7, "q", None),
    ("model.layers.7.self_attn.k_proj.weight", 7, "k", None),
    ("model.layers.7.self_attn.v_proj.weight", 7, "v", None),
    ("model.layers.7.self_attn.o_proj.weight", 7, "o", None),
    ("model.layers.7.mlp.gate_proj.weight", 7, "gate", None),
    ("model.layers.7.mlp.up_proj.weight", 7, "up", None),
    ("model.layers.7.mlp.down_proj.weight", 7, "down", None),
    ("model.layers.7.mlp.down_proj.bias", 7, "bias", None),
    ("model.layers.7.input_layernorm.weight", 7, "norm", None),
    ("blk.7.attn_q.weight", 7, "q", None),
    ("blk.7.attn_output.weight", 7, "o", None),
    ("blk.7.ffn_down.weight", 7, "down", None),
    ("blk.7.ffn_norm.weight", 7, "norm", None),
    ("blk.12.ffn_up_exps.weight", 12, "experts", None),
    ("blk.12.ffn_gate_inp.weight", 12, "router", None),
    ("encoder.layer.3.attention.self.query.weight", 3, "q", None),
    ("encoder.layer.3.attention.self.key.weight", 3, "k", None),
    ("encoder.layer.3.attention.self.value.weight", 3, "v", None),
    ("encoder.layer.3.attention.output.dense.weight", 3, "o", None),
    ("encoder.layer.3.attention.output.LayerNorm.weight", 3, "norm", None),
    ("encoder.layer.3.intermediate.dense.weight", 3, "up", None),
    ("encoder.layer.3.output.dense.weight", 3, "down", None),
    ("embeddings.word_embeddings.weight", None, "embed", None),
    ("pooler.dense.weight", None, None, None),
    ("model.layers.2.mlp.experts.17.up_proj.weight", 2, "experts", 17),
    ("model.layers.2.block_sparse_moe.experts.3.w2.weight", 2, "experts", 3),
    ("model.layers.2.block_sparse_moe.gate.weight", 2, "router", None),
    ("model.layers.2.mlp.gate.weight", 2, "router", None),
    ("model.layers.2.mlp.shared_expert_gate.weight", 2, "router", None),
    ("model.layers.2.mlp.shared_expert.down_proj.weight", 2, "down", None),
    ("model.layers.2.mlp.experts.gate_up_proj", 2, "experts", None),
    ("transformer.h.5.attn.c_attn.weight", 5, "qkv", None),
    ("transformer.h.5.attn.c_proj.weight", 5, "o", None),
    ("transformer.h.5.mlp.c_proj.weight", 5, "down", None),
    ("encoder.block.4.layer.0.SelfAttention.q.weight", 4, "q", None),
    ("encoder.block.4.layer.1.DenseReluDense.wo.weight", 4, "down", None),
    ("layers.9.attention.wo.weight", 9, "o", None),
    ("layers.9.feed_forward.w1.weight", 9, "gate", None),
    ("model.embed_tokens.weight", None, "embed", None),
    ("lm_head.weight", None, "lm_head", None),
    ("output.weight", None, "lm_head", None),
    ("token_embd.weight", None, "embed", None),
    ("model.norm.weight", None, "norm", None),
    ("weight", None, None, None),
    ("", None, None, None),
]


@pytest.mark.parametrize(("name", "layer", "kind", "expert"), EXAMPLES, ids=[e[0] or "empty" for e in EXAMPLES])
def test_examples(name, layer, kind, expert):
    assert weight_position(name) == WeightPosition(layer, kind, expert)


# gguf-py's tensor type -> the kind it means
_GGUF_KINDS = {
    "ATTN_Q": "q", "ATTN_K": "k", "ATTN_V": "v", "ATTN_OUT": "o", "ATTN_QKV": "qkv",
    "FFN_GATE": "gate", "FFN_UP": "up", "FFN_DOWN": "down",
    "FFN_GATE_SHEXP": "gate", "FFN_UP_SHEXP": "up", "FFN_DOWN_SHEXP": "down",
    "FFN_GATE_EXP": "experts", "FFN_UP_EXP": "experts", "FFN_DOWN_EXP": "experts", "FFN_GATE_INP": "router",
    "TOKEN_EMBD": "embed", "OUTPUT": "lm_head", "ATTN_NORM": "norm", "FFN_NORM": "norm", "OUTPUT_NORM": "norm",
}  # fmt: skip
# names where architectures disagree, so no rule from the name alone can be right for all
_AMBIGUOUS = {
    r"transformer\.h\.\d+\.mlp\.w[12]": "one architecture's w1/w2 are up/gate; Meta LLaMA's and Mixtral's w1/w2/w3 are gate/down/up",
    r"transformer_encoder\.\d+\.ffn\.w3": "the same: w3 is down there, up in Meta LLaMA",
    r"model\.layers\.\d+\.moe\.(gate|up|down)_proj": "fused experts under `moe.` without an `experts` part: read as the projection",
    r".*\.mlp\.gate_up_proj": "gguf-py stores the fused gate+up as FFN_UP; we say gate_up",
    r"word_embeddings_for_head": "a tied embedding: we say embed",
}


def test_agrees_with_gguf_tensor_name_map():
    """Every HF name gguf-py maps to one of the kinds above: our kind is the same, or None (not
    recognised, never a wrong kind), and our layer is the block index gguf-py gives."""
    from gguf.constants import MODEL_ARCH, MODEL_TENSOR
    from gguf.tensor_mapping import TensorNameMap

    mapping = TensorNameMap(MODEL_ARCH.LLAMA, 3).mapping
    wanted = {getattr(MODEL_TENSOR, key): kind for key, kind in _GGUF_KINDS.items()}
    checked = recognised = 0
    wrong = []
    for name, (tensor, gguf_name) in mapping.items():
        if tensor not in wanted:
            continue
        checked += 1
        position = weight_position(name + ".weight")
        block = re.match(r"blk\.(\d+)\.", gguf_name)
        assert position.layer == (int(block.group(1)) if block else None), name
        if position.kind is None:
            continue
        recognised += 1
        if position.kind != wanted[tensor] and not any(re.fullmatch(p, name) for p in _AMBIGUOUS):
            wrong.append((name, wanted[tensor], position.kind))
    assert not wrong
    assert checked > 500 and recognised > 0.8 * checked, (checked, recognised)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_name_parses(name):
    position = weight_position(name)
    assert position.kind is None or position.kind in KINDS
    assert position.layer is None or 0 <= position.layer < 10**9
    assert position.expert is None or 0 <= position.expert < 10**9


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["model.layers", "blk", "encoder.layer", "transformer.h", "model.language_model.layers"]),
    st.integers(0, 10**9 - 1),
    st.sampled_from(["self_attn.q_proj", "mlp.down_proj", "attn_k", "ffn_up"]),
    st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_layer_and_expert_round_trip(prefix, layer, module, expert):
    name = f"{prefix}.{layer}.{'mlp.experts.' + str(expert) + '.' if expert is not None else ''}{module}.weight"
    position = weight_position(name)
    assert position.layer == layer
    assert position.expert == expert
    assert (position.kind == "experts") == (expert is not None)


def test_hostile_indices_are_no_index():
    assert weight_position("model.layers." + "9" * 10 + ".mlp.down_proj.weight").layer is None
    assert weight_position("model.layers.٣.mlp.down_proj.weight").layer is None  # a non-ASCII digit
    assert weight_position("model.layers.1.mlp.experts." + "1" * 5000 + ".up_proj.weight").expert is None


def test_long_names_stay_linear():
    import time

    name = ".".join(["layers", "1"] * 100_000) + ".weight"
    started = time.perf_counter()
    weight_position(name)
    assert time.perf_counter() - started < 1.0
