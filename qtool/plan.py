"""What a write plans before any data is read, in the words every layout, encoder and the
executor share:

    Chosen         what becomes of each weight (`qtool.selection` answers it): a scheme, or kept
    Plan           everything a run writes: one Job per input weight, the output files, the
                   container's metadata, config.json, where it goes; `--dry-run` prints it
    Job            one input weight and what becomes of it: its action (quantize, dequantize,
                   copy, cast), the tensors it writes, and for the executor the transform its
                   values take on the way out and the encoding its tensors are in
    OutputTensor   one tensor written: name, container dtype ("I32", "Q4_K"), shape, bytes
    Piece          bytes of one output tensor at an offset within it, as an encoder yields them
    Calibrated     what a calibration stage made for a plan (per weight: precomputed codes or
                   importance rows, a changed float tensor; the metadata it records), which the
                   executor applies beside the plan

A plan is a value: `Plan` and `Job` are frozen, and nothing changes them once planning
(`qtool.planning`, the layouts) has made them; a stage that runs after planning returns what it
made instead (`Calibrated`), and `Calibrated.over` gives the plan the executor writes, a new value.
A layout fills the plan; an encoder (`qtool.encoders`, chosen by capability) turns a job's
values into pieces; the executor (`qtool.pipeline`) reads, applies what the job says, and
writes. None of these knows a file format beyond what the plan says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from collections.abc import Mapping

from qtool.ggml_types import GgmlType
from qtool.scheme import QScheme
from qtool.weight import Weight

if TYPE_CHECKING:
    import numpy as np

    from qtool.calibration.imatrix import ImatrixRequest
    from qtool.calibration.request import CalibrationRequest
    from qtool.formats.checkpoint import Checkpoint
    from qtool.formats.imatrix import Imatrix
    from qtool.layouts.base import Layout

__all__ = [
    "QUANTIZE", "DEQUANTIZE", "COPY", "CAST",
    "Chosen", "Piece", "OutputTensor", "Transform", "IntRows", "GgmlBlocks", "Precomputed", "Mover", "Moved", "Encoding", "Job", "PlanOptions", "Plan",
    "GgufEntry", "Metadata", "Calibrated", "TensorLayout",
]  # fmt: skip

QUANTIZE, DEQUANTIZE, COPY, CAST = "quantize", "dequantize", "copy", "cast"

Piece = tuple[str, Any, int]  # (output tensor name, bytes-like, byte offset within that tensor)


@dataclass(frozen=True)
class Chosen:
    """What becomes of each weight: quantized with `schemes[name]`, else kept as a float of
    `keep_as[name]` where a rule names one (llama.cpp's F16 for rows that fit no block), else
    kept as it is. `mix` names the llama.cpp file type the choice follows, if any."""

    schemes: dict[str, QScheme] = field(default_factory=dict)
    keep_as: dict[str, str] = field(default_factory=dict)
    mix: str | None = None
    notes: tuple[str, ...] = ()  # per tensor, where a rule did something worth knowing (a row fallback)
    said: tuple[str, ...] | None = None  # what a run says of the notes (one line per fallback kind); None: the notes

    def get(self, name: str) -> QScheme | None:
        return self.schemes.get(name)

    @property
    def distinct(self) -> set[QScheme]:
        return set(self.schemes.values())


@dataclass(frozen=True)
class OutputTensor:
    """One tensor a layout writes: its name, the container's dtype name ("I32", "Q4_0"), its
    shape in PyTorch order, and its exact size in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class Transform(Protocol):
    """A change a layout makes to a weight's values on the way out (llama.cpp's rotary order of
    q and k rows), declared in the plan; the executor applies it and knows nothing more."""

    def apply(self, values: Any, rows: int) -> Any:
        """`values` (raw row-major bytes, or a tensor whose first dim is the rows) changed."""
        ...


@runtime_checkable
class TensorLayout(Protocol):
    """What the torch and precomputed encoders need of a layout (`qtool.layouts.base.Layout`)
    beyond the plan: its tensors for a weight, encoded in torch (the reference every other encoder
    of the layout matches), and a weight's values back from them (to measure codes encoded before
    the run). The safetensors layouts have it; GGUF's block types are encoded by their own backends."""

    def encode_tensors(self, name: str, tensor: Any, scheme: QScheme) -> dict[str, Any]: ...

    def reconstruct(
        self, name: str, encoded: dict[str, Any], scheme: QScheme, shape: tuple[int, ...], dtype: str
    ) -> Any: ...


@dataclass(frozen=True)
class IntRows:
    """compressed-tensors pack-quantized ints with one scale (and zero point) per group of a
    row, scales in the weight's own dtype: what a fused kernel writes in one pass."""

    bits: int
    group: int
    symmetric: bool
    observer: str = "minmax"  # how the scales are chosen: "minmax" or "mse" (qtool.kernels.mse)


@dataclass(frozen=True)
class GgmlBlocks:
    """GGML blocks of one type (its `qtool.ggml_types` row), row after row. `importance`, where
    an importance matrix covers the weight (llama.cpp's `--imatrix`), is a float32 array of one
    weight per input column (shape [columns], or [experts, columns] for a 3-D expert tensor),
    handed to the kernels as llama.cpp's `quant_weights`; None quantizes without one."""

    type: GgmlType
    importance: np.ndarray | None = field(default=None, hash=False, compare=False)


@dataclass(frozen=True)
class Precomputed:
    """Tensors encoded before the run, by a stage that needs more than the weight to choose its
    codes (calibration: GPTQ): the layout's own tensors for this weight, by output name, on the
    CPU. The executor writes them as they are and measures them against the weight."""

    tensors: dict[str, Any] = field(hash=False, compare=False)
    algorithm: str = "gptq"


class Mover(Protocol):
    """How a quantized weight's own codes become a target's bytes (`qtool.layouts.moves`),
    declared in the plan as a transform is; the encoder calls it and knows nothing more."""

    target: str  # "compressed-tensors", or a GGML type name

    def move(self, name: str, codes: Any) -> Any:
        """`codes` (`qtool.weight_codes.IntCodes`) as the target holds them exactly: (scheme,
        tensors by name) for a safetensors layout, the blocks' bytes for GGUF; or, as a str,
        why they cannot be."""
        ...


@dataclass(frozen=True)
class Moved:
    """A quantized weight's own integer codes, scales and zero points moved into the target as
    they are, never decoded and quantized again (`qtool convert`): the encoder asks `mover`,
    and refuses a weight whose move would not be exact, naming why."""

    mover: Mover


Encoding = IntRows | GgmlBlocks | Precomputed | Moved


@dataclass(frozen=True)
class Job:
    """One input weight and what becomes of it; frozen once planned."""

    weight: Weight
    action: str  # QUANTIZE | DEQUANTIZE | COPY | CAST
    outputs: list[OutputTensor]
    scheme: QScheme | None = None  # the scheme written, for QUANTIZE
    out_dtype: str | None = None  # the float dtype written, for DEQUANTIZE and CAST
    shard: int = 0
    transform: Transform | None = None  # applied to the values before they are encoded or written
    encoding: Encoding | None = None  # the bytes the outputs hold, for encoders that write exactly those

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
    imatrix: Imatrix | None = None  # GGUF: an importance matrix the quantizers weigh
    imatrix_name: str = ""  # the imatrix path as the user gave it (quantize.imatrix.file)
    imatrix_pending: bool = False  # GGUF: an importance matrix is computed after planning (--calibrate)
    hugging_face_names: bool = False  # safetensors from a llama/qwen2 GGUF: Hugging Face names and q/k row order


GgufEntry = tuple[str, Any, str]  # a GGUF key-value: key, value (as gguf_writer takes it), its GGUF type name
# the container's own metadata: safetensors' `__metadata__`, or GGUF's architecture and key-values
Metadata = dict[str, str] | tuple[str | None, list[GgufEntry]]


@dataclass(frozen=True)
class Plan:
    """Everything a run writes, fixed before any data is read, and never changed after: a
    calibration stage's results are applied beside it (`Calibrated.over`)."""

    source: Checkpoint
    layout: Layout  # the layout that planned it, and writes the headers
    jobs: list[Job]
    files: list[str]  # output file names, in shard order
    metadata: Metadata
    config: dict[str, Any] | None  # config.json to write beside the weights, or None
    notes: list[str] = field(default_factory=list)  # the details, in the --dry-run document
    said: list[str] | None = None  # what a run warns of them (fewer lines: one per fallback kind); None: the notes
    # where it goes, set by the API once the paths are checked
    output: str | None = None
    single_file: bool = False
    report: str | None = None  # where the report document is written, if anywhere (HTML by a .html suffix)
    html: str | None = None  # where the HTML report is written, if anywhere
    warnings: tuple[str, ...] = ()  # for the user: requantizing, side files left behind, the notes
    calibration: CalibrationRequest | ImatrixRequest | None = None  # a calibration stage to run before the executor
    # files written beside the weights as they are, after the layout's own (qtool convert's tokenizer
    # and generation config, rendered while planning): (file name, bytes)
    side_bytes: tuple[tuple[str, bytes], ...] = ()

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
            **({"output": self.output} if self.output is not None else {}),
            **({"calibration": self.calibration.to_json()} if self.calibration is not None else {}),
        }


@dataclass(frozen=True)
class Calibrated:
    """What a calibration stage made for a plan, by input weight name: `encodings` replace a
    quantized job's (GPTQ's and AWQ's `Precomputed` codes, a GGUF job's `GgmlBlocks` with
    importance rows), `transforms` change a copied or cast float tensor (AWQ's smoothed norm);
    `metadata`, where given, is the container metadata with what the stage records (the
    `quantize.imatrix.*` keys). `document` is the report's `calibration` part."""

    document: Mapping[str, Any]
    encodings: Mapping[str, Encoding] = field(default_factory=dict)
    transforms: Mapping[str, Transform] = field(default_factory=dict)
    metadata: Metadata | None = None

    def over(self, plan: Plan) -> Plan:
        """The plan the executor writes: `plan`'s jobs with these results, a new value (`plan`
        is not changed). A result for a weight the plan does not write, or a transform of a job
        that is not a plain copy or cast, is an internal error."""
        from dataclasses import replace

        from qtool.errors import InternalError

        jobs = []
        for job in plan.jobs:
            name = job.weight.name
            if name in self.encodings:
                if job.action != QUANTIZE:
                    raise InternalError(f"{name}: calibration encoded it, but the plan {job.action}s it")
                job = replace(job, encoding=self.encodings[name])
            if name in self.transforms:
                if job.action not in (COPY, CAST) or job.transform is not None:
                    raise InternalError(f"{name}: calibration changed it, but the plan {job.action}s it")
                job = replace(job, transform=self.transforms[name])
            jobs.append(job)
        unknown = (set(self.encodings) | set(self.transforms)) - {job.weight.name for job in plan.jobs}
        if unknown:
            raise InternalError(f"calibration changed {sorted(unknown)[0]}, which the plan does not write")
        return replace(plan, jobs=jobs, metadata=plan.metadata if self.metadata is None else self.metadata)
