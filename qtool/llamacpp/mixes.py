"""llama.cpp's type mixes: which GGML type each tensor of a GGUF model gets for a file type
such as Q4_K_M, as `llama-quantize` decides it.

The rules were read from llama.cpp commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f
(`src/llama-quant.cpp`: `tensor_allows_quantization`, `tensor_get_category`,
`llama_tensor_get_type_impl`, `tensor_type_fallback`, `llama_ftype_get_default_type`,
`init_quantize_state_counters`, and the tensor order of `llama_model_loader::weights_map`) and
are written here from that reading, for the file types qtool offers. A committed table made by
the real `llama-quantize` (tests/fixtures/gguf_mix) checks them.

What decides a tensor's type:

- whether llama.cpp quantizes it at all (`allows_quantization`): 2-D or more by ggml's count (a
  `[1, n]` tensor is 1-D), a name ending in `weight`, not a norm, not an expert router, not a
  positional or token-type embedding, and a list of small tensors of other architectures;
- the file type's default type (Q4_K for Q4_K_M), promoted per category: `output.weight` (and
  `token_embd.weight` when the output is tied to it) to Q6_K, `attn_v` by its rank among the
  `attn_v` tensors (`use_more_bits`), `ffn_down` by its layer, `attn_output` for some mixes;
- the model: `{arch}.block_count` (the `ffn_down` layer count), heads over kv heads (GQA), the
  expert count (8 experts: attn_v and attn_k in Q8_0), Falcon, and LLaMA-70B's shape;
- a row whose length is not a multiple of the block: Q2_K and Q3_K fall back to Q4_0, Q4_K to
  Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, the 256-value IQ types to IQ4_NL, and a 32-block type that
  still does not fit to F16;
- whether an importance matrix is given (`has_imatrix`): without one IQ4_XS promotes the first
  eighth of `ffn_down` to Q5_K; with one Q4_0 gives them Q4_1 instead.

llama.cpp counts `attn_v` tensors and `ffn_down` layers in its own order (by layer number, then
by name), not in file order; so does `choose_types`.

`Q4_K`, `Q3_K` and `Q5_K` without a suffix are "pure" here (every tensor llama.cpp quantizes in
that one type, with the row fallbacks: `llama-quantize --pure`), where llama-quantize reads them
as aliases of the _M mixes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable, Mapping

from qtool.errors import CheckpointError
from qtool.ggml_types import GgmlType, ggml_type_named

__all__ = [
    "LLAMA_CPP_COMMIT",
    "Mix",
    "MIXES",
    "mix_named",
    "ModelFacts",
    "MixTensor",
    "Choice",
    "allows_quantization",
    "choose_types",
    "fallback_type",
    "fallback_summary",
    "requires_imatrix",
    "FLOAT_TYPES",
]

LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"

FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class Mix:
    """One llama.cpp file type: its name, `llama_ftype` (LlamaFileType member), default tensor
    type, whether it is pure, and llama-quantize's own size figure for Llama-3-8B."""

    name: str
    ftype: str
    default_type: str
    pure: bool
    nominal: str
    imatrix: bool = False  # llama-quantize makes it only with an importance matrix

    @property
    def description(self) -> str:
        if self.pure:
            return f"llama.cpp file type, pure: every tensor llama.cpp quantizes in {self.default_type} (row fallbacks), like llama-quantize --pure"
        needs = "; only with an importance matrix (--imatrix or --calibrate)" if self.imatrix else ""
        return f"llama.cpp's {self.name} mix: {self.default_type} with llama.cpp's per-tensor promotions ({self.nominal}){needs}"


def _mix(name: str, ftype: str, default: str, nominal: str, pure: bool = False, imatrix: bool = False) -> Mix:
    return Mix(name, ftype, default, pure, nominal, imatrix)


# name -> mix, in llama-quantize's order. Figures: llama-quantize's own (tools/quantize/quantize.cpp).
MIXES: dict[str, Mix] = {
    m.name: m
    for m in (
        _mix("Q2_K", "MOSTLY_Q2_K", "Q2_K", "2.96G, +3.5199 ppl @ Llama-3-8B"),
        _mix("Q3_K_S", "MOSTLY_Q3_K_S", "Q3_K", "3.41G, +1.6321 ppl @ Llama-3-8B"),
        _mix("Q3_K_M", "MOSTLY_Q3_K_M", "Q3_K", "3.74G, +0.6569 ppl @ Llama-3-8B"),
        _mix("Q3_K_L", "MOSTLY_Q3_K_L", "Q3_K", "4.03G, +0.5562 ppl @ Llama-3-8B"),
        _mix("Q4_K_S", "MOSTLY_Q4_K_S", "Q4_K", "4.37G, +0.2689 ppl @ Llama-3-8B"),
        _mix("Q4_K_M", "MOSTLY_Q4_K_M", "Q4_K", "4.58G, +0.1754 ppl @ Llama-3-8B"),
        _mix("Q5_K_S", "MOSTLY_Q5_K_S", "Q5_K", "5.21G, +0.1049 ppl @ Llama-3-8B"),
        _mix("Q5_K_M", "MOSTLY_Q5_K_M", "Q5_K", "5.33G, +0.0569 ppl @ Llama-3-8B"),
        _mix("Q6_K", "MOSTLY_Q6_K", "Q6_K", "6.14G, +0.0217 ppl @ Llama-3-8B"),
        _mix("Q8_0", "MOSTLY_Q8_0", "Q8_0", "7.96G, +0.0026 ppl @ Llama-3-8B"),
        _mix("Q4_0", "MOSTLY_Q4_0", "Q4_0", "4.34G, +0.4685 ppl @ Llama-3-8B"),
        _mix("IQ4_XS", "MOSTLY_IQ4_XS", "IQ4_XS", "4.25 bpw non-linear quantization"),
        _mix("IQ3_S", "MOSTLY_IQ3_S", "IQ3_S", "3.44 bpw quantization"),
        _mix("IQ3_M", "MOSTLY_IQ3_M", "IQ3_S", "3.66 bpw quantization mix"),
        # llama-quantize makes these only with an importance matrix (--imatrix)
        _mix("IQ3_XXS", "MOSTLY_IQ3_XXS", "IQ3_XXS", "3.06 bpw quantization", imatrix=True),
        _mix("IQ2_M", "MOSTLY_IQ2_M", "IQ2_S", "2.7 bpw quantization", imatrix=True),
        _mix("IQ2_S", "MOSTLY_IQ2_S", "IQ2_XS", "2.5 bpw quantization", imatrix=True),
        _mix("IQ2_XS", "MOSTLY_IQ2_XS", "IQ2_XS", "2.31 bpw quantization", imatrix=True),
        _mix("IQ2_XXS", "MOSTLY_IQ2_XXS", "IQ2_XXS", "2.06 bpw quantization", imatrix=True),
        # pure: llama-quantize --pure with the _M file type, whose default type this is
        _mix("Q3_K", "MOSTLY_Q3_K_M", "Q3_K", "", pure=True),
        _mix("Q4_K", "MOSTLY_Q4_K_M", "Q4_K", "", pure=True),
        _mix("Q5_K", "MOSTLY_Q5_K_M", "Q5_K", "", pure=True),
    )
}


def mix_named(text: str) -> Mix | None:
    """The mix spelled `text` exactly as llama.cpp names it (capitals), or None. Lowercase
    `q8_0`, `q4_0`, `q4_k`... are one block type on qtool's selection, not a mix."""
    return MIXES.get(text.strip())


@dataclass(frozen=True)
class ModelFacts:
    """What of the model the rules read (llama.cpp's hparams)."""

    arch: str = ""
    n_layer: int = 0  # {arch}.block_count: n_layer_all, the ffn_down layer count
    n_head: int = 0
    n_head_kv: int = 0
    n_expert: int = 0

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        """llama.cpp's LLM_TYPE_70B, the one model size the rules name (attn_v gets Q5_K)."""
        if self.arch == "llama":
            return self.n_layer == 80 and self.n_head != self.n_head_kv
        return (self.arch in ("qwen2", "deci", "olmo") and self.n_layer == 80) or (
            self.arch == "jais2" and self.n_layer == 68
        )

    @classmethod
    def from_metadata(cls, values: Mapping[str, Any]) -> ModelFacts:
        """From GGUF key-values (plain Python values): the architecture's block, head, kv-head
        and expert counts; a per-layer array counts by its first layer, as n_gqa(0) does."""
        arch = values.get("general.architecture")
        arch = arch.decode("utf-8", "replace") if isinstance(arch, (bytes, bytearray)) else str(arch or "")

        def count(key: str, default: int = 0) -> int:
            value = values.get(f"{arch}.{key}")
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default

        heads = count("attention.head_count")
        return cls(arch, count("block_count"), heads, count("attention.head_count_kv", heads), count("expert_count"))


@dataclass(frozen=True)
class MixTensor:
    """One tensor as the rules see it: its GGUF name, shape in PyTorch order, current type,
    whether it may be quantized at all (a float or, when requantizing, a quantized tensor not
    left out by --ignore/--include), and the type a --tensor-scheme names for it."""

    name: str
    shape: tuple[int, ...]
    type: str
    candidate: bool = True
    override: str | None = None


@dataclass(frozen=True)
class Choice:
    """The type a tensor gets, and why when it is not the plain rule (fallback, override)."""

    type: str
    note: str | None = None
    fallback: tuple[str, int] | None = None  # (the type wanted, the row length it did not fit)


# -- which tensors llama.cpp quantizes ---------------------------------------------------------

_NEVER = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
    "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight",
    "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight",
    "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight",
    "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
    "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos",
    ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)  # fmt: skip
_NEVER_GLM5_NEXT = (
    "hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate", "indexer_compressor_ape",
    "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight", "ssm_g_b.weight", "ssm_beta.weight",
    "attn_kv_a_mqa.weight", "attn_k_b.weight", "attn_v_b.weight",
)  # fmt: skip


def ggml_n_dims(shape: tuple[int, ...]) -> int:
    """ggml's dimension count: up to the last (in ggml order) dimension longer than 1, at least 1."""
    for index, size in enumerate(shape):
        if size > 1:
            return len(shape) - index
    return 1


def allows_quantization(name: str, shape: tuple[int, ...], arch: str) -> bool:
    """llama.cpp's `tensor_allows_quantization` with default parameters."""
    if ggml_n_dims(shape) < 2:
        return False
    # llama.cpp tests `rfind("weight") == size() - 6` on unsigned sizes: a 5-character name passes
    if not (name.endswith("weight") or len(name) == 5):
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    if any(part in name for part in _NEVER):
        return False
    return not (arch == "glm5-next" and any(part in name for part in _NEVER_GLM5_NEXT))


# -- categories, counters and order ------------------------------------------------------------

OUTPUT, TOKEN_EMBD, QKV, KV_B, ATTN_V, ATTN_K, ATTN_Q, ATTN_OUTPUT, FFN_UP, FFN_GATE, FFN_DOWN, OTHER = (
    "output", "token_embd", "attn_qkv", "attn_kv_b", "attn_v", "attn_k", "attn_q", "attn_output", "ffn_up", "ffn_gate", "ffn_down", "other",
)  # fmt: skip
_CATEGORIES = (
    ("attn_qkv.weight", QKV), ("attn_kv_b.weight", KV_B), ("attn_v.weight", ATTN_V), ("attn_k.weight", ATTN_K),
    ("attn_q.weight", ATTN_Q), ("attn_output.weight", ATTN_OUTPUT), ("ffn_up", FFN_UP), ("ffn_gate", FFN_GATE), ("ffn_down", FFN_DOWN),
)  # fmt: skip
_ATTN_V_LIKE = (ATTN_V, QKV, KV_B)


def category(name: str) -> str:
    """llama.cpp's `tensor_get_category`: the first substring that matches, in its order."""
    if name == "output.weight":
        return OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return TOKEN_EMBD
    return next((cat for part, cat in _CATEGORIES if part in name), OTHER)


_LAYER = re.compile(r"blk\.[ \t\n\v\f\r]*([+-]?[0-9]+)")  # sscanf(name, "blk.%d.")


def layer_of(name: str) -> int | None:
    found = _LAYER.match(name)
    return int(found.group(1)) if found else None


def llama_order(names: Iterable[str]) -> list[str]:
    """The order llama.cpp walks a model's tensors in (`weight_name_comparer`): by layer number
    (-1 outside blocks), then by name (bytes)."""

    def key(name: str) -> tuple[int, bytes]:
        layer = layer_of(name)
        return (-1 if layer is None else layer, name.encode("utf-8", "surrogateescape"))

    return sorted(names, key=key)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    eighth = _cdiv(n_layers, 8)
    return i_layer < eighth or i_layer >= _cdiv(7 * n_layers, 8) or (i_layer - eighth) % 3 == 2


def _cdiv(a: int, b: int) -> int:
    """C's integer division (towards zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def block_size(gguf_type: str) -> int:
    """ggml_blck_size of a type, from the one table."""
    return ggml_type_named(gguf_type).block_size


_IQ2_MIXES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M")  # llama.cpp's IQ1_S, IQ1_M share their rules (not offered)


def fallback_type(cols: int, target: str) -> tuple[str, bool]:
    """`tensor_type_fallback`: the type a row of `cols` values can take instead of `target`
    (its row's `fallback`), and whether a fallback happened."""
    gtype = ggml_type_named(target)
    if cols % gtype.block_size == 0:
        return target, False
    demoted = gtype.fallback or target
    if block_size(demoted) > 32:
        raise CheckpointError(
            f"llama.cpp defines no fallback for {target} when rows are not a multiple of {gtype.block_size}"
        )
    if cols % block_size(demoted):
        demoted = "F16"
    return demoted, True


class _State:
    """llama.cpp's quantize_state_impl counters for one model."""

    def __init__(self, facts: ModelFacts, n_attention_wv: int, tied: bool, has_imatrix: bool = False) -> None:
        self.facts = facts
        self.has_imatrix = has_imatrix  # qs.has_imatrix: llama-quantize was given an importance matrix
        self.n_attention_wv = n_attention_wv
        self.n_ffn = facts.n_layer  # n_ffn_down = n_ffn_gate = n_ffn_up = n_layer_all
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0
        self.tied = tied

    def layer(self, counter: int, name: str) -> tuple[int, int]:
        """(i_layer, n_layer) for an ffn tensor: the running counter, or with experts the
        layer in the name (llama.cpp stops when it cannot find one)."""
        n_layer = self.n_ffn
        if max(1, self.facts.n_expert) > 1:
            layer = layer_of(name)
            if layer is None:
                raise CheckpointError(
                    f"tensor {name}: cannot tell its layer (llama.cpp reads blk.N. in the names of a model with experts)"
                )
            if not 0 <= layer < n_layer:
                raise CheckpointError(
                    f"tensor {name}: layer {layer} is outside [0, {n_layer}) (the model's block_count)"
                )
            return layer, n_layer
        return counter, n_layer


def _mixed_type(state: _State, mix: Mix, new: str, tensor: MixTensor, cat: str) -> str:
    """`llama_tensor_get_type_impl` for the file types in MIXES."""
    facts, name, ftype = state.facts, tensor.name, mix.name
    falcon = facts.arch == "falcon"
    if facts.arch == "glm5-next" and any(part in name for part in ("attn_q_a", "attn_q_b", "nextn.eh_proj")):
        if new not in FLOAT_TYPES:
            return "Q8_0"
    if cat == OUTPUT or (state.tied and cat == TOKEN_EMBD):
        cols = tensor.shape[-1]
        if falcon or cols % block_size(new):
            return "Q8_0"
        if ftype in _IQ2_MIXES or ftype == "IQ3_XXS":
            return "Q5_K"
        return new if new == "Q8_0" else "Q6_K"
    if cat == TOKEN_EMBD:
        return {"IQ2_XXS": "Q2_K", "IQ2_XS": "Q2_K", "IQ2_S": "IQ3_S", "IQ2_M": "IQ3_S", "IQ3_XXS": "IQ3_S"}.get(
            ftype, new
        )
    if ftype in _IQ2_MIXES:  # one branch for every other tensor of these mixes
        iq3_s = ftype in ("IQ2_S", "IQ2_M")
        if cat in _ATTN_V_LIKE:
            new = "Q4_K" if facts.n_gqa >= 4 or facts.n_expert >= 4 else "IQ3_S" if iq3_s else "Q2_K"
            state.i_attention_wv += 1
        elif facts.n_expert == 8 and cat == ATTN_K:
            new = "Q4_K"
        elif cat == FFN_DOWN:  # the running counter, even with experts
            if state.i_ffn_down < _cdiv(state.n_ffn, 8):
                new = "IQ3_S" if iq3_s else "Q2_K"
            state.i_ffn_down += 1
        elif cat == ATTN_OUTPUT:
            if facts.n_expert == 8:
                new = "Q5_K"
            elif iq3_s:
                new = "IQ3_S"
        return new
    if cat in _ATTN_V_LIKE:
        i, n = state.i_attention_wv, state.n_attention_wv
        if ftype == "Q2_K":
            new = "Q4_K" if facts.n_gqa >= 4 else "Q3_K"
        elif ftype == "Q3_K_M":
            new = "Q5_K" if i < 2 else "Q4_K"
        elif ftype == "Q3_K_L":
            new = "Q5_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and i < 4:
            new = "Q5_K"
        elif ftype == "IQ3_S" and facts.n_gqa >= 4:
            new = "Q4_K"
        elif ftype == "IQ3_M":
            new = "Q4_K"
        elif ftype == "IQ4_XS" and facts.n_gqa >= 4:
            new = "Q5_K"
        elif ftype == "IQ3_XXS":
            new = "Q4_K" if facts.n_gqa >= 4 else "IQ3_XXS" if state.has_imatrix else "IQ3_S"
        if facts.is_70b and new in ("Q3_K", "Q4_K"):
            new = "Q5_K"
        if facts.n_expert == 8:
            new = "Q8_0"
        state.i_attention_wv += 1
        return new
    if cat == ATTN_K:
        return "Q8_0" if facts.n_expert == 8 else "IQ2_S" if ftype == "IQ3_XXS" else new
    if cat == ATTN_Q:
        return "IQ2_S" if ftype == "IQ3_XXS" else new
    if cat == FFN_DOWN:
        i_layer, n_layer = state.layer(state.i_ffn_down, name)
        eighth = _cdiv(n_layer, 8)
        if ftype == "Q2_K":
            new = "Q3_K"
        elif ftype == "Q3_K_M":
            new = (
                "Q5_K"
                if i_layer < _cdiv(n_layer, 16)
                else "Q4_K"
                if not falcon or use_more_bits(i_layer, n_layer)
                else "Q3_K"
            )
        elif ftype == "Q3_K_L":
            new = "Q4_K" if falcon else "Q5_K"
        elif ftype == "Q4_K_M":
            if falcon:
                new = "Q6_K" if i_layer < _cdiv(n_layer, 16) else "Q5_K" if use_more_bits(i_layer, n_layer) else "Q4_K"
            elif use_more_bits(i_layer, n_layer):
                new = "Q6_K"
        elif ftype == "Q5_K_M" and use_more_bits(i_layer, n_layer):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and not falcon and i_layer < eighth:
            new = "Q5_K"
        elif ftype in ("Q4_0", "Q5_0") and state.has_imatrix and i_layer < eighth:
            new = "Q4_1" if ftype == "Q4_0" else "Q5_1"  # llama.cpp's guard, only with an imatrix
        elif ftype == "IQ3_M" and (i_layer < eighth or (facts.n_expert == 8 and use_more_bits(i_layer, n_layer))):
            new = "Q4_K"
        elif ftype == "IQ4_XS" and i_layer < eighth and not state.has_imatrix:
            new = "Q5_K"
        elif ftype == "IQ3_XXS" and not state.has_imatrix:
            new = "Q4_K" if i_layer < eighth else "Q3_K"
        state.i_ffn_down += 1
        return new
    if cat == ATTN_OUTPUT:
        if not falcon:
            if facts.n_expert == 8:
                if ftype in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M", "IQ3_S", "IQ3_M", "IQ4_XS", "IQ3_XXS"):
                    new = "Q5_K"
            else:
                new = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K", "IQ3_M": "Q4_K", "IQ3_XXS": "IQ3_S"}.get(
                    ftype, new
                )
        elif ftype == "Q3_K_L":
            new = "Q4_K"
        return new
    if cat == FFN_GATE:
        state.layer(state.i_ffn_gate, name)
        state.i_ffn_gate += 1
    elif cat == FFN_UP:
        state.layer(state.i_ffn_up, name)
        state.i_ffn_up += 1
    return new


def choose_types(
    mix: Mix, tensors: list[MixTensor], facts: ModelFacts, *, has_imatrix: bool = False
) -> dict[str, Choice]:
    """Every tensor's type under `mix`, keyed by name: what `llama_tensor_get_type` gives, in
    llama.cpp's walking order (the counters depend on it). A tensor llama.cpp does not quantize,
    or that is not a candidate, keeps its type. `has_imatrix`: an importance matrix was given
    (some rules differ: Q4_0's first ffn_down layers in Q4_1)."""
    by_name = {t.name: t for t in tensors}
    cats = {t.name: category(t.name) for t in tensors}
    state = _State(
        facts,
        sum(1 for c in cats.values() if c in _ATTN_V_LIKE),
        tied=OUTPUT not in cats.values(),
        has_imatrix=has_imatrix,
    )
    chosen: dict[str, Choice] = {}
    for name in llama_order(by_name):
        tensor = by_name[name]
        if not (tensor.candidate and allows_quantization(name, tensor.shape, facts.arch)):
            chosen[name] = Choice(tensor.type)
            continue
        if tensor.override is not None:  # llama-quantize --tensor-type: no promotions, no counting
            new, note = tensor.override, "--tensor-scheme"
        else:
            new, note = mix.default_type, None
            if not mix.pure:
                new = _mixed_type(state, mix, new, tensor, cats[name])
        cols = tensor.shape[-1] if tensor.shape else 1
        final, fell = fallback_type(cols, new)
        if fell:
            note = f"rows of {cols} values are not a multiple of the {new} block ({block_size(new)}): {final} instead"
        chosen[name] = Choice(final, note, (new, cols) if fell else None)
    return {t.name: chosen[t.name] for t in tensors}


def fallback_summary(choices: list[Choice]) -> list[str]:
    """One line per kind of row fallback (Q4_K -> Q5_0) among `choices`, with how many tensors
    and which row lengths: what a run says, where each tensor's own note is in the plan."""
    kinds: dict[tuple[str, str], tuple[int, set[int]]] = {}
    for choice in choices:
        if choice.fallback is not None:
            wanted, cols = choice.fallback
            count, lengths = kinds.get((wanted, choice.type), (0, set()))
            lengths.add(cols)
            kinds[(wanted, choice.type)] = (count + 1, lengths)
    lines = []
    for (wanted, final), (count, lengths) in kinds.items():
        shown = sorted(lengths)
        values = ", ".join(map(str, shown[:-1])) + f" or {shown[-1]}" if len(shown) > 1 else str(shown[0])
        tensors = "tensor falls" if count == 1 else "tensors fall"
        lines.append(
            f"{count} {tensors} back from {wanted} to {final}: their rows of {values} values are not a multiple of {wanted}'s block ({block_size(wanted)}); each is listed in --dry-run --json's notes"
        )
    return lines


def requires_imatrix(name: str, gtype: GgmlType, mix: str | None) -> bool:
    """llama.cpp's `tensor_requires_imatrix`: the types whose output is garbage without one
    (their row says so: IQ1, IQ2, IQ3_XXS; Q2_K only in a Q2_K_S file), never for token_embd
    or output."""
    if name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    return gtype.llama_quantize_needs_imatrix or (gtype.name == "Q2_K" and mix == "Q2_K_S")


def bits_per_weight_on_llama3_8b(mix: Mix) -> float:
    """The mix's storage bits per weight on Llama-3-8B's tensor shapes (BF16 input, 32 layers,
    GQA 4, vocabulary 128256, untied output): the figure `qtool schemes` shows, worked out from
    the same rules the writer follows, so it cannot drift from what a run writes."""
    hidden, kv, ffn, vocab, layers = 4096, 1024, 14336, 128256, 32
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        for name, shape in (
            ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)),
            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn)), ("attn_norm", (hidden,)), ("ffn_norm", (hidden,)),
        ):  # fmt: skip
            shapes[f"blk.{i}.{name}.weight"] = shape
    tensors = [MixTensor(name, shape, "BF16" if len(shape) == 2 else "F32") for name, shape in shapes.items()]
    chosen = choose_types(mix, tensors, ModelFacts("llama", layers, 32, 8), has_imatrix=mix.imatrix)
    values = bits = 0
    for tensor in tensors:
        count = math.prod(tensor.shape)
        values += count
        bits += ggml_type_named(chosen[tensor.name].type).nbytes(count) * 8
    return bits / values
