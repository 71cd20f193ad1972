"""Which weights `qtool quantize` quantizes, and with which scheme.

By default: 2-D floating `*.weight` tensors of linear layers. Embeddings, `lm_head`, norms,
biases and anything non-floating are skipped: quantizing those hurts quality for little gain,
and no loader expects them quantized. `--include` replaces the default rule with patterns,
`--ignore` removes matches, `--tensor-scheme PATTERN=SCHEME` picks a scheme per pattern (and
selects what it matches). The first matching override wins.
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
    if weight.dtype not in FLOAT_DTYPES:
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
        overrides = []
        for item in tensor_schemes:
            pattern, sep, value = item.rpartition("=")
            if not sep or not pattern or not value:
                raise UsageError(f"tensor scheme {item!r} is not PATTERN=SCHEME", hint="e.g. 're:.*down_proj.*=int8'", option="tensor_schemes")
            compile_pattern(pattern)  # a bad regex fails here, with its own message
            overrides.append((pattern, parse_scheme_option(value, "tensor scheme")))
        for pattern in (*include, *ignore):
            compile_pattern(pattern)
        return cls(parse_scheme_option(scheme), include, ignore, overrides)

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
        for weight in weights:
            override = next((s for match, s in overrides if match(weight.name)), None)
            if include:
                wanted = any(match(weight.name) for match in include)
            else:
                wanted = default_selects(weight.name)
            wanted = (wanted or override is not None) and not any(match(weight.name) for match in ignore)
            chosen[weight.name] = (override or self.scheme) if wanted and quantizable(weight) is None else None
        return chosen
