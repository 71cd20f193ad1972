"""The scheme strings users type, and the QScheme each one is: compressed-tensors' preset names
where they exist (`W4A16`, `FP8_BLOCK`, `NVFP4A16`, ...), and a short form
`<type>[:<granularity>][:sym|asym]`, granularity being tensor | channel | g<N> | block<H>x<W>.
Any of them may end in `:mse` or `:minmax`, the observer that chooses the scales (`W4A16:mse`).
Presets and words such as "channel" and "g128" become a block shape here, once. llama.cpp's
block types in lowercase (`q8_0`, `q4_k`, ...) are the rows of `qtool.ggml_types`.

llama.cpp's file types in capitals (`Q4_K_M`) are not schemes but selection rules
(`qtool.selection`); here they only earn a better message.
"""

from __future__ import annotations

import re

from qtool.errors import SchemeError
from qtool.ggml_types import ggml_type_named
from qtool.qtypes import qtype
from qtool.scheme import AUTO, CHANNEL, OBSERVERS, TENSOR, Block, QScheme, group

__all__ = ["PRESETS", "SHORT_FORMS", "parse_scheme", "scheme_names"]


def _ct(name: str, block: Block, symmetric: bool = True, scale: str = AUTO, global_scale: bool = False) -> QScheme:
    return QScheme(qtype(name), block, symmetric, scale, zero_point=not symmetric, global_scale=global_scale)


def _llama(name: str) -> QScheme:
    scheme = ggml_type_named(name).scheme
    if scheme is None:  # the table's rows for these names are block types
        raise SchemeError(f"GGML type {name} has no scheme")
    return scheme


# name -> (scheme, what it is). Presets are matched case-insensitively.
PRESETS: dict[str, tuple[QScheme, str]] = {
    "W8A16": (_ct("int8", group(128)), "int8 weights, symmetric, group 128 (compressed-tensors preset)"),
    "W4A16": (_ct("int4", group(128)), "int4 weights, symmetric, group 128 (compressed-tensors preset)"),
    "W4A16_ASYM": (_ct("int4", group(128), symmetric=False), "int4 weights with zero points, group 128"),
    "FP8": (_ct("fp8_e4m3", TENSOR), "fp8 e4m3 weights, one scale per tensor"),
    "FP8_DYNAMIC": (
        _ct("fp8_e4m3", CHANNEL),
        "fp8 e4m3 weights, one scale per output channel; dynamic per-token activations",
    ),
    "FP8_BLOCK": (_ct("fp8_e4m3", (128, 128)), "fp8 e4m3 weights in 128x128 blocks (DeepSeek-V3 style)"),
    "NVFP4A16": (
        _ct("fp4_e2m1", group(16), scale="F8_E4M3", global_scale=True),
        "fp4 e2m1, e4m3 scales per 16, one f32 global scale",
    ),
    "MXFP4A16": (_ct("fp4_e2m1", group(32), scale="E8M0"), "fp4 e2m1 with power-of-two e8m0 scales per 32 (OCP MX)"),
}

_DEFAULT_BLOCK = {
    "int8": CHANNEL,
    "int4": group(128),
    "int3": group(128),
    "int2": group(64),
    "fp8_e4m3": TENSOR,
    "fp8_e5m2": TENSOR,
    "nf4": group(64),
}
_ALIASES = {
    "fp8": "fp8_e4m3",
    "int8": "int8",
    "int4": "int4",
    "int3": "int3",
    "int2": "int2",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "nf4": "nf4",
}

# llama.cpp's block types `--scheme` takes, by their names in lowercase (each is its
# `qtool.ggml_types` row's scheme); the others are written only under a mix
_LLAMA_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")

# the examples `qtool schemes` lists besides the presets; every one must parse
SHORT_FORMS = (
    "int8",
    "int4:g128",
    "int4:g64:asym",
    "int2:g64",
    "fp8_e4m3:channel",
    "fp8:block128x128",
    "nf4:g64",
    "mxfp4",
    "nvfp4",
    *_LLAMA_TYPES,
)

# short-form aliases of named formats whose granularity is fixed
_FIXED = {
    "mxfp4": PRESETS["MXFP4A16"][0],
    "nvfp4": PRESETS["NVFP4A16"][0],
    **{name: _llama(name) for name in _LLAMA_TYPES},
}


def scheme_names() -> list[str]:
    return [*PRESETS, *SHORT_FORMS]


def parse_scheme(text: str) -> QScheme:
    """A preset name or short form, optionally ending in `:<observer>` -> QScheme. The
    SchemeError lists the valid names and a close match."""
    from dataclasses import replace

    head, sep, tail = text.strip().rpartition(":")
    if sep and head and tail.lower() in OBSERVERS:
        return replace(_parse_plain(head, text), observer=tail.lower())
    return _parse_plain(text, text)


def _parse_plain(name: str, text: str) -> QScheme:
    name = name.strip()
    for preset, (scheme, _) in PRESETS.items():
        if name.upper() == preset:
            return scheme
    lowered = name.lower()
    if lowered in _FIXED:
        return _FIXED[lowered]
    head, *mods = lowered.split(":")
    if head in _FIXED:
        raise _unknown(text, f"{head} has a fixed layout; write just {head!r}")
    if head not in _ALIASES:
        raise _unknown(text)
    value = _ALIASES[head]
    block: Block = _DEFAULT_BLOCK[value]
    symmetric = True
    for mod in mods:
        if mod in ("sym", "asym"):
            symmetric = mod == "sym"
        elif mod == "tensor":
            block = TENSOR
        elif mod == "channel":
            block = CHANNEL
        elif re.fullmatch(r"g[1-9]\d*", mod):
            block = group(int(mod[1:]))
        elif re.fullmatch(r"block[1-9]\d*x[1-9]\d*", mod):
            rows, cols = mod[5:].split("x")
            block = (int(rows), int(cols))
        else:
            raise _unknown(
                text,
                f"unknown part {mod!r}: use tensor, channel, g<N>, block<H>x<W>, sym or asym; an observer (mse, minmax) comes last",
            )
    if not symmetric and value.startswith(("fp8", "nf4")):
        raise _unknown(text, f"{value} is symmetric only")
    if value == "nf4":
        if block[0] != 1 or block[-1] is None:
            raise _unknown(text, "nf4 takes a group size, e.g. nf4:g64")
        return QScheme(qtype("nf4"), block, True, "F32")
    return _ct(value, block, symmetric)


def _unknown(text: str, why: str | None = None) -> SchemeError:

    if why is None and re.fullmatch(r"Q[2-6]_K_[SML]", text.strip().upper()):
        why = "a llama.cpp file type (a mix of GGUF types), which only quantize --scheme takes; name one type here, e.g. q4_k"

    message = f"unknown scheme {text!r}" + (f": {why}" if why else "")
    return SchemeError(message, hint=scheme_hint(text))


def scheme_hint(text: str, file_types: tuple[str, ...] = ()) -> str:
    """The hint for an unknown scheme: the closest valid name (among `file_types` too: llama.cpp's
    file types, where the caller takes them, as `quantize`'s scheme does) and every valid name."""
    import difflib

    names = scheme_names()
    every = [*names, *file_types]
    folded = [n.upper() for n in every]  # case-blind: q4_k_m is close to Q4_K_M
    upper = difflib.get_close_matches(text.strip().upper(), folded, n=1, cutoff=0.5)
    close = [every[folded.index(upper[0])]] if upper else []
    listed = "valid: " + ", ".join(names) + (f"; llama.cpp file types: {', '.join(file_types)}" if file_types else "")
    return (f"did you mean {close[0]!r}? " if close else "") + listed
