"""`qtool schemes`: every scheme name qtool accepts, its bits per weight and the layout it writes."""

from __future__ import annotations

from qtool.cli.options import FormatOpt, JsonOpt, OutputFormat
from qtool.cli.output import Column, Output, Rows

HELP = """List the schemes --scheme accepts, with bits per weight and the layout each writes.

Bits per weight count values, scales and zero points for a 4096x4096 bf16 weight.

\b
Examples:
  qtool schemes
  qtool schemes --json | jq '.schemes[] | select(.bits_per_weight < 5) | .name'
"""


def schemes_command(fmt: FormatOpt = OutputFormat.auto, json_: JsonOpt = False) -> None:
    from qtool.layouts import choose_layout
    from qtool.scheme import PRESETS, nominal_bits_per_weight, parse_scheme, scheme_names

    entries = []
    for name in scheme_names():
        scheme = parse_scheme(name)
        entries.append(
            {
                "name": name,
                "label": scheme.label,
                "bits_per_weight": round(nominal_bits_per_weight(scheme), 4),
                "layout": choose_layout({scheme}, None).name,
                "preset": name in PRESETS,
                "description": PRESETS[name][1] if name in PRESETS else "",
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
