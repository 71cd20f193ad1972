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
    from qtool.api import schemes

    document = schemes()
    rows = Rows(
        [
            Column("name"),
            Column("scheme"),
            Column("bits/weight", human=lambda v: f"{v:.3f}", justify="right"),
            Column("writes"),
            Column("what it is"),
        ],
        [[e["name"], e["label"], e["bits_per_weight"], e["layout"], e["description"]] for e in document["schemes"]],
        title="Schemes",
    )
    Output("json" if json_ else fmt.value).emit(document, rows)
