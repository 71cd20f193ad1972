"""Which weights `qtool quantize` quantizes, and with which scheme.

By default: 2-D floating `*.weight` tensors of linear layers. Embeddings, `lm_head`, norms,
biases and anything non-floating are skipped: quantizing those hurts quality for little gain,
and no loader expects them quantized. `--include` replaces the default rule with patterns,
`--ignore` removes matches, `--tensor-scheme PATTERN=SCHEME` picks a scheme per pattern (and
selects what it matches). The first matching override wins.

A llama.cpp file type in capitals (`Q4_K_M`, `Q8_0`, ...: `qtool.layouts.gguf_mix`) is not one
scheme but a mix the gguf layout resolves per tensor with llama.cpp's own rules, including which
tensors are quantized at all; so under a mix every weight is a candidate (less `--ignore`, within
`--include`), and a `--tensor-scheme` names the one GGUF type a matching tensor gets instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from qtool.errors import UsageError
from qtool.patterns import compile_pattern
from qtool.scheme import QScheme, SchemeError, parse_scheme
from qtool.weight import Weight

__all__ = ["Selection", "parse_scheme_option", "default_selects", "SKIP_WORDS"]

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# module-name words that mark a layer no loader expects quantized
SKIP_WORDS = re.compile(r"(^|[._])(embed\w*|wte|wpe|lm_head|norm\w*|\w*_norm|ln_?\w*|\w*layernorm\w*)($|[._])")


def parse_scheme_option(text: str, option: str = "scheme") -> QScheme:
    try:
        return parse_scheme(text)
    except SchemeError as exc:
        raise SchemeError(f"{option}: {exc}", hint=exc.hint, option=option.replace(" ", "_")) from None


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
    module, _, leaf = name.rpartition(".")
    # `output` alone is the LM head in Meta/GGUF naming; `attention.output.dense` is a linear
    return leaf == "weight" and module != "output" and not SKIP_WORDS.search(module)


@dataclass
class Selection:
    scheme: QScheme
    include: list[str]
    ignore: list[str]
    overrides: list[tuple[str, QScheme]]

    @classmethod
    def from_options(cls, scheme: str, include: list[str], ignore: list[str], tensor_schemes: list[str]) -> "Selection":
        from qtool.layouts.gguf_mix import mix_named

        overrides = []
        for item in tensor_schemes:
            pattern, sep, value = item.rpartition("=")
            if not sep or not pattern or not value:
                raise UsageError(f"tensor scheme {item!r} is not PATTERN=SCHEME", hint="e.g. 're:.*down_proj.*=int8'", option="tensor_schemes")
            compile_pattern(pattern)  # a bad regex fails here, with its own message
            try:
                overrides.append((pattern, parse_scheme_option(value, "tensor scheme")))
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
        return cls(mix.scheme if mix is not None else parse_scheme_option(scheme), include, ignore, overrides)

    def _matchers(self) -> tuple[list[Callable[[str], bool]], list[Callable[[str], bool]], list[tuple[Callable[[str], bool], QScheme]]]:
        return (
            [compile_pattern(p) for p in self.include],
            [compile_pattern(p) for p in self.ignore],
            [(compile_pattern(p), s) for p, s in self.overrides],
        )

    def choose(self, weights: list[Weight]) -> dict[str, QScheme | None]:
        """weight name -> scheme, or None to copy it through."""
        include, ignore, overrides = self._matchers()
        chosen: dict[str, QScheme | None] = {}
        mix = self.scheme.gguf_mix is not None
        for weight in weights:
            override = next((s for match, s in overrides if match(weight.name)), None)
            if mix:  # llama.cpp's rules decide in the gguf layout; here only what the user left out
                wanted = (not include or any(match(weight.name) for match in include)) and not any(match(weight.name) for match in ignore)
                chosen[weight.name] = (override or self.scheme) if wanted else None
                continue
            if include:
                wanted = any(match(weight.name) for match in include)
            else:
                wanted = default_selects(weight.name)
            wanted = (wanted or override is not None) and not any(match(weight.name) for match in ignore)
            chosen[weight.name] = (override or self.scheme) if wanted and quantizable(weight) is None else None
        return chosen
