"""What every layout provides, and what the one executor runs.

A **layout** is how one toolchain stores a scheme on disk (DESIGN "The write side"). It answers,
from shapes alone and before any data is read:

- `refusal(scheme)`: why it can never store this scheme (None if it can), and
  `check(weight, scheme)`: a `SchemeError` when it cannot store it for this weight;
- `plan(...)`: every tensor it writes for every weight (names, dtypes, shapes, bytes), the file
  metadata and side config, so `--dry-run` and the headers come from the plan;
- `encoder(job, backend)`: the kernel that turns a weight's values into those tensors, chunk by
  chunk; the backend (fused C on the CPU, torch elsewhere) is chosen by capability.

Decoding is the reading convention's job: every layout round-trips through the reader in a test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from qtool.scheme import QScheme, SchemeError
from qtool.weight import Weight

if TYPE_CHECKING:
    from qtool.formats.checkpoint import Checkpoint
    from qtool.metrics import ErrorStats

__all__ = ["Planned", "Job", "Plan", "Piece", "WeightEncoder", "Layout", "PlanOptions", "refusal_of", "QUANTIZE", "DEQUANTIZE", "COPY", "CAST"]

QUANTIZE, DEQUANTIZE, COPY, CAST = "quantize", "dequantize", "copy", "cast"

Piece = tuple[str, Any, int]  # (output tensor name, bytes-like, byte offset within that tensor)


@dataclass(frozen=True)
class Planned:
    """One tensor a layout writes: its name, the container's dtype name ("I32", "Q4_0"), its
    shape in PyTorch order, and its exact size in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class Job:
    """One input weight and what becomes of it."""

    weight: Weight
    action: str  # QUANTIZE | DEQUANTIZE | COPY | CAST
    outputs: list[Planned]
    scheme: QScheme | None = None  # the scheme written, for QUANTIZE
    out_dtype: str | None = None  # the float dtype written, for DEQUANTIZE and CAST
    shard: int = 0
    rope_heads: int | None = None  # GGUF: rows permuted into llama.cpp's rotary order per head

    @property
    def bytes_in(self) -> int:
        return self.weight.nbytes

    @property
    def bytes_out(self) -> int:
        return sum(t.nbytes for t in self.outputs)


@dataclass(frozen=True)
class PlanOptions:
    """What the user asked of the output, besides the schemes."""

    single_file: bool  # -o names one file rather than a folder
    out_dtype: str | None = None  # cast kept float tensors (and decoded ones) to this
    max_shard_size: int | None = None
    file_name: str = "model.safetensors"
    allow_incomplete_gguf: bool = False  # GGUF: write a model llama.cpp cannot run (no architecture or tokenizer)


@dataclass
class Plan:
    """Everything a run writes, fixed before any data is read."""

    source: "Checkpoint"
    layout: "Layout"
    jobs: list[Job]
    files: list[str]  # output file names, in shard order
    metadata: Any  # the container's own metadata (safetensors `__metadata__`, GGUF key-values)
    config: dict[str, Any] | None  # config.json to write beside the weights, or None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The `--dry-run` document: what each weight becomes, and the sizes before and after."""
        jobs = self.jobs
        before = sum(j.bytes_in for j in jobs)
        after = sum(j.bytes_out for j in jobs)
        parameters = sum(j.weight.parameters for j in jobs)
        return {
            "schema_version": 1,
            "format": self.layout.name,
            "layout": self.layout.name,
            "files": list(self.files),
            "metadata": self.layout.metadata_json(self),
            "summary": {
                "weights": len(jobs),
                "quantized_weights": sum(1 for j in jobs if j.action == QUANTIZE),
                "bytes_before": before,
                "bytes_after": after,
                "bits_per_weight": round(after * 8 / parameters, 4) if parameters else 0.0,
            },
            "weights": [
                {
                    "name": j.weight.name,
                    "action": j.action,
                    "scheme": j.scheme.label if j.scheme else None,
                    "from": j.weight.scheme.label if j.weight.scheme else None,
                    "stored_as": j.weight.data.encoding or j.weight.data.dtype.name,
                    "shape": list(j.weight.shape),
                    "bytes_before": j.bytes_in,
                    "bytes_after": j.bytes_out,
                    "bits_per_weight": round(j.bytes_out * 8 / j.weight.parameters, 4) if j.weight.parameters else 0.0,
                    "file": self.files[j.shard],
                    "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in j.outputs],
                }
                for j in jobs
            ],
            "notes": list(self.notes),
        }


class WeightEncoder(Protocol):
    """One weight's encoder on one backend. `encode` takes what `wants` names ("bytes": the
    stored bytes of the weight, read raw; "tensor": a float torch tensor on the run's device)
    and yields the pieces to write; after it is exhausted, `errors` holds the weight's error
    against the original (None when not measured)."""

    wants: str
    errors: "ErrorStats | None"

    def encode(self, values: Any) -> Iterator[Piece]: ...


class Layout(Protocol):
    name: str
    container: str  # "safetensors" | "gguf": which file writer lays its output out
    description: str

    def refusal(self, scheme: QScheme) -> str | None:
        """Why this layout can never store `scheme`, or None if it can (for some weights)."""
        ...

    def check(self, weight: Weight, scheme: QScheme) -> None:
        """Raise a `SchemeError` saying what is allowed when `scheme` can't be stored for `weight`."""
        ...

    def plan(self, source: "Checkpoint", weights: list[Weight], chosen: dict[str, QScheme | None], options: PlanOptions) -> Plan: ...

    def metadata_json(self, plan: Plan) -> dict[str, Any]:
        """The file metadata the plan writes, as JSON (for `--dry-run`)."""
        ...

    def header(self, plan: Plan, shard: int) -> tuple[bytes, dict[str, tuple[int, int]], int]:
        """File `shard`'s header bytes, each tensor's absolute byte range, and the file's size."""
        ...

    def side_files(self, plan: Plan) -> dict[str, Any]:
        """JSON files written beside the weights (index, config.json), by name."""
        ...

    def encoder(self, job: Job, device: str, measure: bool) -> WeightEncoder: ...



def refusal_of(attempt: Callable[[], object]) -> str | None:
    """The message of the SchemeError `attempt` raises (why a layout refuses), or None."""
    try:
        attempt()
    except SchemeError as exc:
        return exc.message
    return None
