"""What the safetensors layouts share: the plan (jobs, shards, config.json or `__metadata__`)
and the torch encode that `qtool.encoders` runs in row chunks.

A subclass says which tensors it writes for a scheme (`tensors`), how to encode a weight in
torch (`encode_tensors`, the reference), the `quantization_config` it records
(`quantization_config`), and where a fused kernel writes the same bytes, which (`encoding`).
`PlainSafetensors` is the layout with no quantized weights: `qtool dequantize` writes it.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

from qtool.dtypes import WEIGHT_FLOATS, float_dtype_named, nbytes_for, storage_dtype
from qtool.formats.checkpoint import Checkpoint
from qtool.formats.writer import INDEX_NAME, safetensors_layout, shard_name
from qtool.plan import CAST, COPY, DEQUANTIZE, QUANTIZE, Chosen, Encoding, Job, OutputTensor, Plan, PlanOptions
from qtool.scheme import QScheme
from qtool.weight import Weight

__all__ = ["SafetensorsLayout", "PlainSafetensors", "planned", "recorded_dtype", "CHUNK_ELEMENTS"]

CHUNK_ELEMENTS = 4 << 20  # elements per row chunk when quantizing in torch


def _hugging_face_names(jobs: list[Job], source: Checkpoint) -> None:
    """A llama or qwen2 GGUF's tensors written under their Hugging Face names, a llama's q/k rows
    put back in Hugging Face's order (qtool.llamacpp.names); any other input keeps its names.
    Two tensors that would take one name (a stranger's file may hold both `output_norm.weight`
    and `model.norm.weight`) are refused."""
    from qtool.errors import CheckpointError
    from qtool.llamacpp.names import hugging_face_names

    named = hugging_face_names(source)
    if named is None:
        return
    taken: dict[str, str] = {}
    for index, job in enumerate(jobs):
        name, rows = named(job.weight.name)
        if name in taken:
            raise CheckpointError(
                f"tensors {taken[name]!r} and {job.weight.name!r} would both be written as {name!r}", path=source.path
            )
        taken[name] = job.weight.name
        if rows is not None and not rows.fits(job.weight.shape[0]):
            raise CheckpointError(
                f"{job.weight.name!r} has {job.weight.shape[0]} rows, not a whole number of its {rows.heads} rotary heads' pairs",
                path=source.path,
            )
        jobs[index] = replace(job, outputs=[replace(job.outputs[0], name=name)], transform=rows)


def planned(name: str, dtype: str, shape: tuple[int, ...]) -> OutputTensor:
    """A safetensors tensor of `dtype` and `shape`, sized."""
    size = nbytes_for(storage_dtype(dtype), math.prod(shape))
    if size is None:
        raise ValueError(f"{name}: {math.prod(shape)} elements of {dtype} do not fill whole bytes")
    return OutputTensor(name, dtype, tuple(shape), size)


def recorded_dtype(source: Checkpoint, weights: list[Weight]) -> str:
    """The dtype the input records for its float weights (config `torch_dtype`), else the one
    its quantized weights decode to, else bf16."""
    recorded = source.config.get("torch_dtype") or source.config.get("dtype") or ""
    if float_dtype_named(recorded) is not None:
        return float_dtype_named(recorded)
    logical = {w.dtype for w in weights if w.quantized and w.dtype in WEIGHT_FLOATS}
    return logical.pop() if len(logical) == 1 else "BF16"


def _dominant_dtype(weights: list[Weight]) -> str:
    sizes: dict[str, int] = {}
    for weight in weights:
        if weight.dtype in WEIGHT_FLOATS:
            sizes[weight.dtype] = sizes.get(weight.dtype, 0) + weight.parameters
    return max(sizes, key=sizes.__getitem__) if sizes else "BF16"


class SafetensorsLayout:
    """The base of the layouts written as safetensors shards plus config.json."""

    name = "safetensors"
    container = "safetensors"
    description = "plain safetensors"
    metadata_key: str | None = None  # the `__metadata__` key a single-file output records its config under

    # -- what a subclass provides ---------------------------------------------------------------

    def refusal(self, scheme: QScheme) -> str | None:
        return f"{self.name} stores no quantized weights"

    def check(self, weight: Weight, scheme: QScheme) -> None:
        pass

    @staticmethod
    def encoded_layout(
        name: str, shape: tuple[int, ...], dtype: str, scheme: QScheme
    ) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, safetensors dtype, shape) of every tensor written for a weight, from its shape."""
        raise NotImplementedError

    @staticmethod
    def quantization_config(
        schemes_by_module: dict[str, QScheme], ignore: list[str], dtype: str
    ) -> dict[str, Any] | None:
        """The `quantization_config` recorded for these modules."""
        return None

    @staticmethod
    def encode_tensors(name: str, tensor, scheme: QScheme) -> dict[str, Any]:
        """The tensors of `encoded_layout` for these values, in torch."""
        raise NotImplementedError

    def tensors(self, weight: Weight, scheme: QScheme) -> list[OutputTensor]:
        return [
            planned(name, dtype, shape)
            for name, dtype, shape in self.encoded_layout(weight.name, weight.shape, weight.dtype, scheme)
        ]

    def whole_weight(self, encoded: dict[str, Any], shape: tuple[int, ...]) -> dict[str, Any]:
        """A chunk's tensors, with any that describe the whole weight corrected to its shape."""
        return encoded

    def row_chunk(self, weight: Weight, scheme: QScheme) -> int | None:
        """Rows per chunk when a weight's tensors split by rows, else None (encode it whole)."""
        return None

    def encoding(self, weight: Weight, scheme: QScheme) -> Encoding | None:
        """The bytes this weight's tensors hold, where a fused kernel writes exactly those
        (`qtool.plan.IntRows`); None where only the torch encode does."""
        return None

    # -- the plan -------------------------------------------------------------------------------

    def plan(self, source: Checkpoint, weights: list[Weight], chosen: Chosen, options: PlanOptions) -> Plan:
        out_dtype = options.out_dtype
        decoded_dtype = out_dtype or recorded_dtype(source, weights)  # once: a loop over weights stays linear
        jobs: list[Job] = []
        for weight in weights:
            scheme = chosen.get(weight.name)
            if scheme is not None:
                self.check(weight, scheme)
                jobs.append(
                    Job(
                        weight,
                        QUANTIZE,
                        self.tensors(weight, scheme),
                        scheme=scheme,
                        encoding=self.encoding(weight, scheme),
                    )
                )
            elif weight.quantized:  # dequantize, or requantize's weights that stay float
                jobs.append(
                    Job(
                        weight, DEQUANTIZE, [planned(weight.name, decoded_dtype, weight.shape)], out_dtype=decoded_dtype
                    )
                )
            elif out_dtype and weight.dtype in ("F16", "BF16", "F32", "F64") and weight.dtype != out_dtype:
                jobs.append(Job(weight, CAST, [planned(weight.name, out_dtype, weight.shape)], out_dtype=out_dtype))
            else:
                data = weight.data
                jobs.append(
                    Job(weight, COPY, [OutputTensor(weight.name, data.dtype.name, tuple(data.shape), data.nbytes)])
                )
        if options.hugging_face_names:
            _hugging_face_names(jobs, source)
        files = self._shards(jobs, source, options)
        jobs.sort(key=lambda j: j.shard)
        schemes = {j.weight.name.rpartition(".")[0]: j.scheme for j in jobs if j.scheme is not None}
        quant_config = None
        if schemes:
            ignore = sorted(
                {
                    j.weight.name.rpartition(".")[0]
                    for j in jobs
                    if j.scheme is None and len(j.weight.shape) == 2 and j.weight.name.endswith(".weight")
                }
            )
            quant_config = self.quantization_config(schemes, ignore, out_dtype or _dominant_dtype(weights))
        metadata = {"format": "pt"}
        config = None
        if options.single_file:
            if quant_config is not None and self.metadata_key:  # one file describes itself
                metadata[self.metadata_key] = json.dumps(quant_config, separators=(",", ":"))
        else:
            config = dict(source.config)
            config.pop("quantization_config", None)
            if quant_config is not None:
                config["quantization_config"] = quant_config
            config = config or None
        return Plan(source, self, jobs, files, metadata, config)

    @staticmethod
    def _shards(jobs: list[Job], source: Checkpoint, options: PlanOptions) -> list[str]:
        """Assign each job a shard; by default follow the input's sharding."""
        from qtool.errors import UsageError

        if options.single_file:
            if options.max_shard_size and sum(j.bytes_out for j in jobs) > options.max_shard_size:
                raise UsageError("a single-file output cannot be split into shards", hint="write to a folder instead")
            return [options.file_name]
        if options.max_shard_size:
            shard, size = 0, 0
            for index, job in enumerate(jobs):
                if size and size + job.bytes_out > options.max_shard_size:
                    shard, size = shard + 1, 0
                jobs[index], size = replace(job, shard=shard), size + job.bytes_out
            count = shard + 1
        else:
            files = {path: i for i, path in enumerate(source.files)}
            stored = [files.get(job.weight.data.file, 0) for job in jobs]
            renumber = {old: new for new, old in enumerate(sorted(set(stored)))}
            jobs[:] = [replace(job, shard=renumber[shard]) for job, shard in zip(jobs, stored)]
            count = len(renumber) or 1
        return [shard_name(i, count) for i in range(count)]

    def metadata_json(self, plan: Plan) -> dict[str, Any]:
        return dict(plan.metadata)

    def header(self, plan: Plan, shard: int) -> tuple[bytes, dict[str, tuple[int, int]], int]:
        """Shard `shard`'s header bytes, each tensor's absolute byte range, and the file size."""
        return safetensors_layout([t for job in plan.jobs if job.shard == shard for t in job.outputs], plan.metadata)

    def side_files(self, plan: Plan) -> dict[str, Any]:
        """The JSON files written beside the weights: the index of a sharded output, config.json."""
        files: dict[str, Any] = {}
        if len(plan.files) > 1:
            weight_map = {t.name: plan.files[j.shard] for j in plan.jobs for t in j.outputs}
            files[INDEX_NAME] = {
                "metadata": {"total_size": sum(j.bytes_out for j in plan.jobs)},
                "weight_map": weight_map,
            }
        if plan.config is not None:
            files["config.json"] = plan.config
        return files

    # -- encoding: the torch reference, which qtool.encoders runs ---------------------------------

    def reconstruct(self, name: str, encoded: dict[str, Any], scheme: QScheme, shape: tuple[int, ...], dtype: str):
        """Decode freshly encoded tensors through this layout's reading convention."""
        from qtool.conventions import REGISTRY
        from qtool.errors import InternalError
        from qtool.formats.memory import MemoryCheckpoint

        config = self.quantization_config({name.rpartition(".")[0]: scheme}, [], dtype)
        checkpoint = MemoryCheckpoint(encoded, {"config.json": {"quantization_config": config}})
        convention = next(c for c in REGISTRY if c.name == self.name)
        weights = [w for w in convention.detect(checkpoint, dict(checkpoint.tensors)) if w.quantized]
        if len(weights) != 1 or weights[0].shape != tuple(shape):
            raise InternalError(
                f"{name}: qtool cannot read back what it encoded ({[(w.name, w.shape) for w in weights]})"
            )
        device = next(iter(encoded.values())).device
        return convention.decode(checkpoint, weights[0], device)


class PlainSafetensors(SafetensorsLayout):
    """Plain float safetensors: what `qtool dequantize` writes."""
