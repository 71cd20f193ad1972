"""The `qtool schemes` catalogue: every scheme `--scheme` takes, with its bits per weight and
the layout planning would choose for it, and llama.cpp's file types (mixes)."""

from __future__ import annotations

from typing import Any

__all__ = ["catalogue"]


def catalogue() -> dict[str, Any]:
    """The `qtool schemes` document: every scheme name `--scheme` takes, with its bits per
    weight (for a 4096x4096 bf16 weight; exact for a GGUF block type), the layout that writes
    it, and llama.cpp's file types with their bits on Llama-3-8B's shapes."""
    from qtool.ggml_types import type_for
    from qtool.layouts import choose_layout
    from qtool.llamacpp.mixes import MIXES, bits_per_weight_on_llama3_8b
    from qtool.scheme import nominal_bits_per_weight
    from qtool.scheme_strings import PRESETS, parse_scheme, scheme_names

    entries = []
    for name in scheme_names():
        scheme = parse_scheme(name)
        if scheme.rule is not None:
            gtype = type_for(scheme)
            bits = gtype.type_size * 8 / gtype.block_size
            description = f"one GGUF block type, {scheme.rule}, on the weights qtool selects"
        else:
            bits = nominal_bits_per_weight(scheme)
            description = PRESETS[name][1] if name in PRESETS else ""
        entries.append(
            {
                "name": name,
                "kind": "scheme",
                "label": scheme.label,
                "bits_per_weight": round(bits, 4),
                "layout": choose_layout({scheme}, None).name,
                "preset": name in PRESETS,
                "description": description,
            }
        )
    for mix in MIXES.values():
        entries.append(
            {
                "name": mix.name,
                "kind": "gguf mix",
                "label": f"{mix.name} (llama.cpp file type)",
                "bits_per_weight": round(bits_per_weight_on_llama3_8b(mix), 4),  # per model: Llama-3-8B's shapes
                "layout": "gguf",
                "preset": False,
                "description": mix.description,
            }
        )
    return {"schema_version": 1, "schemes": entries}
