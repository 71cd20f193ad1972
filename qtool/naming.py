"""Weight names across toolchains: user rename rules, and the built-in GGUF <-> Hugging Face
map for LLaMA-family models, so that `qtool compare` can pair `blk.0.attn_q.weight` with
`model.layers.0.self_attn.q_proj.weight`.

A rename rule is `OLD=NEW`:

    re:^blk\\.(\\d+)\\.=model.layers.\\1.     `re:` regex, anchored at the start (re.match, as in
                                          every qtool pattern); the matched prefix becomes NEW,
                                          which may use \\1 or \\g<name>
    transformer.h.=model.layers.          a literal prefix

The split is at the last `=`, so a regex may hold `(?=...)`.

The GGUF names are the ones llama.cpp's converter writes for LLaMA (gguf-py `TensorNameMap`,
architecture LLM_ARCH_LLAMA); tests check this table against the installed package.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Callable, Mapping, Sequence

from qtool.errors import UsageError
from qtool.patterns import REGEX_PREFIX, BoundedRegex, compile_regex

__all__ = ["Rename", "parse_rename", "rename", "gguf_to_hf", "hf_to_gguf", "rope_heads", "GGUF_ROPE_PERMUTED"]


@dataclass(frozen=True)
class Rename:
    text: str  # as the user wrote it
    apply: Callable[[str], str]

    def __call__(self, name: str) -> str:
        return self.apply(name)


def parse_rename(text: str, option: str = "map rule") -> Rename:
    old, sep, new = text.rpartition("=")
    if not sep or not old:
        raise UsageError(
            f"{option} '{text}' is not OLD=NEW", hint=r"e.g. 're:^blk\.(\d+)\.=model.layers.\1.'", option="maps"
        )
    if old.startswith(REGEX_PREFIX):
        try:  # bounded in time, as every user regex (qtool.patterns)
            regex = compile_regex(old[len(REGEX_PREFIX) :], f"{option} '{text}'")
        except ValueError as exc:
            raise UsageError(f"{option} '{text}': invalid regex: {exc}", option="maps") from None
        try:  # a bad group reference in NEW fails here, not in the middle of a run
            _check_template(regex, new)
        except re.error as exc:
            raise UsageError(f"{option} '{text}': invalid replacement '{new}': {exc}", option="maps") from None

        def by_regex(name: str) -> str:
            match = regex.match(name)
            return name if match is None else match.expand(new) + name[match.end() :]

        return Rename(text, by_regex)

    def by_prefix(name: str) -> str:
        return new + name[len(old) :] if name.startswith(old) else name

    return Rename(text, by_prefix)


def _check_template(regex: BoundedRegex, template: str) -> None:
    """Expand `template` against a fake match with every group present, so \\3 on a regex with
    two groups is refused up front."""
    for ref in re.findall(r"\\(\d+)|\\g<(\w+)>", template):
        number, named = ref
        if number and int(number) > regex.groups:
            raise re.error(f"invalid group reference {number}: the regex has {regex.groups} groups")
        if named and not named.isdigit() and named not in regex.groupindex:
            raise re.error(f"unknown group name {named!r}")
        if named.isdigit() and int(named) > regex.groups:
            raise re.error(f"invalid group reference {named}: the regex has {regex.groups} groups")


def rename(name: str, rules: Sequence[Rename]) -> str:
    """Every rule in order, each on the result of the one before."""
    for rule in rules:
        name = rule(name)
    return name


# -- GGUF <-> Hugging Face, LLaMA family -----------------------------------------------------------

_GGUF_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_HF_TOP = {hf: gguf for gguf, hf in _GGUF_TOP.items()}
_HF_BLOCK = {hf: gguf for gguf, hf in _GGUF_BLOCK.items()}
_GGUF_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HF_NAME = re.compile(r"model\.layers\.(\d+)\.([\w.]+)\.(weight|bias)")

# GGUF architectures whose q/k rows llama.cpp's converter permutes (`LlamaModel.permute`)
GGUF_ROPE_PERMUTED = ("llama",)


def gguf_to_hf(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; other names unchanged."""
    match = _GGUF_NAME.fullmatch(name)
    if match:
        block, part, leaf = match.groups()
        hf = _GGUF_BLOCK.get(part)
        return f"model.layers.{block}.{hf}.{leaf}" if hf else name
    module, dot, leaf = name.rpartition(".")
    return f"{_GGUF_TOP[module]}.{leaf}" if dot and module in _GGUF_TOP else name


def hf_to_gguf(name: str) -> str:
    """The inverse of `gguf_to_hf`."""
    match = _HF_NAME.fullmatch(name)
    if match:
        block, part, leaf = match.groups()
        gguf = _HF_BLOCK.get(part)
        return f"blk.{block}.{gguf}.{leaf}" if gguf else name
    module, dot, leaf = name.rpartition(".")
    return f"{_HF_TOP[module]}.{leaf}" if dot and module in _HF_TOP else name


def rope_heads(hf_name: str, metadata: Mapping[str, str]) -> int | None:
    """How many heads a GGUF file's rows of this weight were permuted over, or None if they
    were not: q by `{arch}.attention.head_count`, k by `head_count_kv` (default: head_count)."""
    arch = metadata.get("general.architecture", "")
    if arch not in GGUF_ROPE_PERMUTED:
        return None
    heads = metadata.get(f"{arch}.attention.head_count")
    if hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        heads = metadata.get(f"{arch}.attention.head_count_kv", heads)
    elif not hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return None
    try:
        count = int(str(heads))
    except ValueError:
        return None
    return count if count > 0 else None
