"""The write side: one `Layout` per toolchain that qtool writes, registered by name like the
conventions on the read side (see `qtool.layouts.base` for the protocol).

    compressed-tensors   int1-8, fp8, mxfp4/mxfp8, nvfp4 safetensors (vLLM, transformers)
    bitsandbytes         nf4 / fp4 safetensors (transformers)
    gguf                 one .gguf file (llama.cpp)
    safetensors          plain float safetensors (what `dequantize` writes)

With no layout named, a run takes the first layout in this order that can store every chosen
scheme, so `--scheme nf4:g64` writes bitsandbytes and `--scheme q4_0` writes GGUF; `-o x.gguf`
asks for GGUF.
"""

from __future__ import annotations

import difflib

from qtool.errors import SchemeError
from qtool.layouts.base import Layout
from qtool.scheme import QScheme

__all__ = ["LAYOUTS", "layout_named", "choose_layout", "Layout"]


def _registry() -> dict[str, Layout]:
    from qtool.layouts.bitsandbytes import Bitsandbytes
    from qtool.layouts.compressed_tensors import CompressedTensors
    from qtool.layouts.gguf import Gguf
    from qtool.layouts.safetensors import PlainSafetensors

    return {layout.name: layout for layout in (CompressedTensors(), Bitsandbytes(), Gguf(), PlainSafetensors())}


LAYOUTS: dict[str, Layout] = _registry()


def layout_named(name: str) -> Layout:
    """The layout called `name`; a SchemeError lists the names, with a close match."""
    layout = LAYOUTS.get(name.lower())
    if layout is None:
        close = difflib.get_close_matches(name.lower(), list(LAYOUTS), n=1, cutoff=0.5)
        raise SchemeError(
            f"unknown layout {name!r}",
            hint=(f"did you mean {close[0]!r}? " if close else "") + "known: " + ", ".join(LAYOUTS),
        )
    return layout


def choose_layout(schemes: set[QScheme], requested: str | None) -> Layout:
    """The layout that stores every scheme: `requested`, or the first in LAYOUTS that can."""
    if requested not in (None, "auto"):
        layout = layout_named(requested)
        for scheme in sorted(schemes, key=lambda s: s.label):
            why = layout.refusal(scheme)
            if why is not None:
                able = [name for name, other in LAYOUTS.items() if other.refusal(scheme) is None]
                raise SchemeError(
                    f"the {layout.name} layout cannot store {scheme.label}: {why}",
                    hint=f"{scheme.label} is written by: {', '.join(able) or 'no layout qtool has'}",
                )
        return layout
    for layout in LAYOUTS.values():
        if all(layout.refusal(scheme) is None for scheme in schemes):
            return layout
    labels = ", ".join(sorted(s.label for s in schemes))
    raise SchemeError(
        f"no one layout stores all of {labels}",
        hint="pick schemes that one layout writes (see `qtool schemes`), one layout per run",
    )
