"""Which weights `qtool quantize` quantizes, and with which scheme: the step from what the user
asked (`--scheme`, `--include`, `--ignore`, `--tensor-scheme`) to one `QScheme` per weight.

By default: 2-D floating `*.weight` tensors of linear layers. Embeddings, `lm_head`, norms,
MoE routers (`mlp.gate`, `block_sparse_moe.gate`, `shared_expert_gate`, `router`), biases and
anything non-floating are skipped: quantizing those hurts quality for little gain, and no
loader expects them quantized. `--include` replaces the default rule with patterns,
`--ignore` removes matches, `--tensor-scheme PATTERN=SCHEME` picks a scheme per pattern (and
selects what it matches). The first matching override wins.

A llama.cpp file type in capitals (`Q4_K_M`, `Q8_0`, ...: `qtool.llamacpp.mixes`) is a second
selection rule, not a scheme: llama.cpp's own rules decide, per tensor of the model as GGUF
names it, which tensors are quantized and in which GGML type, including a float type where a
row fits no block (`Chosen.keep_as`). Under a mix every weight is a candidate (less `--ignore`,
within `--include`), and a `--tensor-scheme` names the one GGUF type a matching tensor gets
instead, like llama-quantize's `--tensor-type`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from qtool.errors import SchemeError, UsageError
from qtool.formats.checkpoint import Checkpoint
from qtool.patterns import compile_pattern
from qtool.plan import Chosen
from qtool.scheme import OBSERVERS, QScheme
from qtool.scheme_strings import parse_scheme, scheme_hint
from qtool.weight import Weight
from qtool.weight_position import weight_position

if TYPE_CHECKING:
    from qtool.llamacpp.mixes import Mix

__all__ = ["Selection", "Chosen", "parse_scheme_option", "default_selects", "SKIP_WORDS"]

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# module-name words that mark a layer no loader expects quantized
SKIP_WORDS = re.compile(r"(^|[._])(embed\w*|wte|wpe|lm_head|norm\w*|\w*_norm|ln_?\w*|\w*layernorm\w*)($|[._])")


def parse_scheme_option(text: str, option: str = "scheme") -> QScheme:
    """`text` as a scheme; a bad one is a SchemeError led by `option` as a rule names it (`scheme`,
    `tensor scheme`, `expect-scheme`: what a policy file and a flag both say), whose `option`
    is the API parameter (`expect_scheme`)."""
    try:
        return parse_scheme(text)
    except SchemeError as exc:
        raise SchemeError(
            f"{option}: {exc}", hint=exc.hint, option=option.replace(" ", "_").replace("-", "_")
        ) from None


def quantizable(weight: Weight) -> str | None:
    """Why a weight can't be quantized at all, or None if it can."""
    if len(weight.shape) != 2:
        return f"{len(weight.shape)}-D, only 2-D weights are quantized"
    if weight.dtype not in FLOAT_DTYPES and not weight.quantized:  # a quantized one is decoded first (requantize)
        return f"{weight.dtype} is not a float dtype"
    if 0 in weight.shape:
        return "empty: there is nothing to quantize"
    return None


def default_selects(name: str) -> bool:
    """Whether the default rule quantizes a weight named `name`: a linear `*.weight` that is
    not an embedding, head or norm, nor a mixture's router (llm-compressor's and vLLM's
    convention: a router is tiny and routing is sensitive to its error; named by `--include` or
    `--tensor-scheme`, one is quantized)."""
    module, _, leaf = name.rpartition(".")
    # `output` alone is the LM head in Meta/GGUF naming; `attention.output.dense` is a linear
    if leaf != "weight" or module == "output" or SKIP_WORDS.search(module):
        return False
    return weight_position(name).kind != "router"


Matcher = Callable[[str], bool]


@dataclass(frozen=True)
class Selection:
    """What the user asked: a scheme (or a llama.cpp mix) for the selected weights, and the
    patterns that select and override."""

    scheme: QScheme | None  # None under a mix
    include: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    overrides: tuple[tuple[str, QScheme], ...] = ()
    mix: Mix | None = None  # a llama.cpp file type (qtool.llamacpp.mixes.MIXES)

    @classmethod
    def from_options(
        cls,
        scheme: str,
        include: list[str],
        ignore: list[str],
        tensor_schemes: list[str],
        *,
        pure: bool = False,
        observer: str | None = None,
    ) -> Selection:
        """`pure`: a llama.cpp file type's default type on every tensor llama.cpp quantizes,
        with its row fallbacks and none of its promotions (`llama-quantize --pure`).
        `observer` ("minmax", "mse"): how the scales of `scheme` and of every tensor scheme that
        names no observer of its own (`int8:channel:minmax`) are chosen."""
        from dataclasses import replace

        if observer is not None and observer not in OBSERVERS:
            raise UsageError(f"unknown observer {observer!r}", hint=f"known: {', '.join(OBSERVERS)}", option="observer")

        def observed(parsed: QScheme, text: str, what: str) -> QScheme:
            if observer is None or text.strip().rpartition(":")[2].lower() in OBSERVERS:
                return parsed
            try:
                return replace(parsed, observer=observer)
            except SchemeError as exc:
                raise SchemeError(
                    f"{what} {text!r} with observer {observer}: {exc.message}", hint=exc.hint, option="observer"
                ) from None

        from qtool.llamacpp.mixes import mix_named

        overrides = []
        for item in tensor_schemes:
            pattern, sep, value = item.rpartition("=")
            if not sep or not pattern or not value:
                raise UsageError(
                    f"tensor scheme {item!r} is not PATTERN=SCHEME",
                    hint="e.g. 're:.*down_proj.*=int8'",
                    option="tensor_schemes",
                )
            compile_pattern(pattern)  # a bad regex fails here, with its own message
            try:
                overrides.append(
                    (pattern, observed(parse_scheme_option(value, "tensor scheme"), value, "tensor scheme"))
                )
            except SchemeError:
                if mix_named(value.strip().upper()) is None:
                    raise
                raise UsageError(
                    f"tensor scheme {item!r}: {value} is a llama.cpp mix of types, not one type",
                    hint="name one GGUF type for the matching tensors, e.g. 're:.*ffn_down.*=Q6_K'",
                    option="tensor_schemes",
                ) from None
        for pattern in (*include, *ignore):
            compile_pattern(pattern)
        mix = mix_named(scheme)
        if mix is not None and observer not in (None, "minmax"):
            raise SchemeError(
                f"observer {observer}: {scheme} is a llama.cpp file type, GGUF block types with llama.cpp's own block math",
                hint="drop the observer for GGUF output, or quantize to an int scheme (e.g. W4A16)",
                option="observer",
            )
        if mix is not None:
            return cls(None, tuple(include), tuple(ignore), tuple(overrides), replace(mix, pure=True) if pure else mix)
        if pure:
            raise UsageError(
                f"pure applies to llama.cpp's file types (Q2_K, Q4_K_M, ...), not to {scheme!r}",
                hint="a lowercase GGUF type (q4_k) is already one type on the weights qtool selects",
                option="pure",
            )
        try:
            parsed = parse_scheme_option(scheme)
        except SchemeError as exc:  # here a llama.cpp file type is valid too: the hint lists them
            from qtool.llamacpp.mixes import MIXES

            raise SchemeError(exc.message, hint=scheme_hint(scheme, tuple(MIXES)), option="scheme") from None
        return cls(observed(parsed, scheme, "scheme"), tuple(include), tuple(ignore), tuple(overrides))

    def _matchers(self) -> tuple[list[Matcher], list[Matcher], list[tuple[Matcher, QScheme]]]:
        return (
            [compile_pattern(p) for p in self.include],
            [compile_pattern(p) for p in self.ignore],
            [(compile_pattern(p), s) for p, s in self.overrides],
        )

    def choose(
        self,
        checkpoint: Checkpoint,
        weights: list[Weight],
        *,
        allow_incomplete_gguf: bool = False,
        has_imatrix: bool = False,
    ) -> Chosen:
        """Each weight's scheme (weights left out are kept). `has_imatrix`: an importance matrix
        comes with the run, which changes some of llama.cpp's rules for a mix."""
        include, ignore, overrides = self._matchers()
        if self.mix is not None:
            return _mix_choice(
                self.mix, checkpoint, weights, include, ignore, overrides, allow_incomplete_gguf, has_imatrix
            )
        chosen: dict[str, QScheme] = {}
        for weight in weights:
            override = next((s for match, s in overrides if match(weight.name)), None)
            wanted = any(match(weight.name) for match in include) if include else default_selects(weight.name)
            wanted = (wanted or override is not None) and not any(match(weight.name) for match in ignore)
            if wanted and quantizable(weight) is None:
                chosen[weight.name] = override or self.scheme
        return Chosen(chosen)


def _mix_choice(
    mix: Mix,
    checkpoint: Checkpoint,
    weights: list[Weight],
    include: list[Matcher],
    ignore: list[Matcher],
    overrides: list[tuple[Matcher, QScheme]],
    allow_incomplete: bool,
    has_imatrix: bool = False,
) -> Chosen:
    """llama.cpp's rules for a file type (`llama_tensor_get_type`, on the GGUF names), as one
    GGML type's scheme per quantized weight and a float type where a row fits no block."""
    from qtool.ggml_types import ggml_type_named, type_for
    from qtool.llamacpp.mixes import FLOAT_TYPES, MixTensor, choose_types, fallback_summary
    from qtool.llamacpp.names import tensor_names

    names = tensor_names(checkpoint, allow_incomplete)
    tensors, out_names, stored_types = [], {}, {}
    for weight in weights:
        out_name = names.tensor_name(weight.name)
        if out_name is None:  # a buffer llama.cpp does not read: not written at all
            continue
        out_names[weight.name] = out_name
        wanted = (not include or any(match(weight.name) for match in include)) and not any(
            match(weight.name) for match in ignore
        )
        stored = stored_types[weight.name] = weight.data.encoding or weight.data.dtype.name
        candidate = wanted and (weight.quantized or stored in FLOAT_TYPES)
        override = next((s for match, s in overrides if match(weight.name)), None) if candidate else None
        override_type = None
        if override is not None:
            gtype = type_for(override)
            if gtype is None:
                raise SchemeError(
                    f"GGUF has no block type for {override.label}",
                    hint="a tensor scheme under a llama.cpp mix names one GGUF type, e.g. q6_k",
                    option="tensor_schemes",
                )
            override_type = gtype.name
        tensors.append(MixTensor(out_name, tuple(weight.shape), stored, candidate, override_type))
    by_out = choose_types(mix, tensors, _model_facts(checkpoint), has_imatrix=has_imatrix)
    schemes: dict[str, QScheme] = {}
    keep_as: dict[str, str] = {}
    notes, said = [], []  # every tensor's note (the plan's), and what a run says: one line per fallback kind
    for name, out_name in out_names.items():
        choice = by_out[out_name]
        if choice.note:
            notes.append(f"{out_name}: {choice.note}")
            if choice.fallback is None:
                said.append(notes[-1])
        if choice.type == stored_types[name]:  # kept as it is stored
            continue
        if choice.type in FLOAT_TYPES:
            keep_as[name] = choice.type
            continue
        scheme = ggml_type_named(choice.type).scheme
        if scheme is None:
            raise SchemeError(f"{out_name}: llama.cpp's rules chose {choice.type}, which qtool cannot write")
        schemes[name] = scheme
    said.extend(fallback_summary([by_out[out_name] for out_name in out_names.values()]))
    return Chosen(schemes, keep_as, mix.name, tuple(notes), tuple(said))


def _model_facts(checkpoint: Checkpoint) -> Any:
    """What of the model llama.cpp's rules read: from a GGUF input's key-values, else config.json."""
    from qtool.llamacpp.mixes import ModelFacts
    from qtool.llamacpp.names import architecture

    if checkpoint.format == "gguf":
        from qtool.formats.gguf import read_gguf_key_values

        return ModelFacts.from_metadata({key: value for key, value, _ in read_gguf_key_values(checkpoint.files[0])})
    config = checkpoint.config
    heads, kv = _count(config.get("num_attention_heads")), config.get("num_key_value_heads")
    return ModelFacts(
        architecture(config)[0] or "unknown",
        _count(config.get("num_hidden_layers")), heads, _count(kv) if isinstance(kv, int) else heads,
        _count(config.get("num_local_experts")),
    )  # fmt: skip


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
