"""`qtool schemes`: every scheme name qtool accepts, its bits per weight and the layout it writes."""

from __future__ import annotations

from qtool.cli.options import FormatOpt, JsonOpt, OutputFormat
from qtool.cli.output import Column, Output, Rows

HELP = """List the schemes --scheme accepts, with bits per weight and the layout each writes.

Bits per weight count values, scales and zero points for a 4096x4096 bf16 weight; for a GGUF
block type they are exact (bytes per block x 8 / values per block).

GGUF names: lowercase q8_0, q4_0, q4_1, q5_0, q5_1, q2_k ... q6_k are one block type for the
weights qtool selects (linear layers by default, like every other scheme). CAPITALS are
llama.cpp's file types as llama-quantize names them: Q4_K_M, Q5_K_S, Q2_K, Q8_0, Q4_0 ... are
mixes (llama.cpp's own choice of tensors and of a type per tensor), whose bits per weight depend
on the model: the figure shown is what the mix writes for Llama-3-8B's tensor shapes, worked out
by the same rules a run follows; Q3_K, Q4_K and Q5_K are "pure" (every tensor llama.cpp
quantizes in that type, like llama-quantize --pure).

\b
Examples:
  qtool schemes
  qtool schemes --json | jq '.schemes[] | select(.bits_per_weight < 5) | .name'
  qtool schemes --json | jq '.schemes[] | select(.kind == "gguf mix") | .name'
"""


def schemes_command(fmt: FormatOpt = OutputFormat.auto, json_: JsonOpt = False) -> None:
    from qtool.formats.gguf import ggml_type_named
    from qtool.layouts import choose_layout
    from qtool.layouts.gguf_mix import MIXES, bits_per_weight_on_llama3_8b
    from qtool.scheme import PRESETS, nominal_bits_per_weight, parse_scheme, scheme_names

    entries = []
    for name in scheme_names():
        scheme = parse_scheme(name)
        if scheme.gguf_type:
            gtype = ggml_type_named(scheme.gguf_type)
            bits = gtype.type_size * 8 / gtype.block_size
            description = f"one GGUF block type, {scheme.gguf_type}, on the weights qtool selects"
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
                "label": mix.scheme.label,
                "bits_per_weight": round(bits_per_weight_on_llama3_8b(mix), 4),  # per model: Llama-3-8B's shapes
                "layout": "gguf",
                "preset": False,
                "description": mix.description,
            }
        )
    rows = Rows(
        [
            Column("name"),
            Column("scheme"),
            Column("bits/weight", human=lambda v: f"{v:.3f}", justify="right"),
            Column("writes"),
            Column("what it is"),
        ],
        [[e["name"], e["label"], e["bits_per_weight"], e["layout"], e["description"]] for e in entries],
        title="Schemes",
    )
    Output("json" if json_ else fmt.value).emit({"schema_version": 1, "schemes": entries}, rows)
