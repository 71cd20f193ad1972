"""An importance matrix on a GGUF plan, as `llama-quantize --imatrix` uses one
(src/llama-quant.cpp `llama_model_quantize_impl`, tools/quantize/quantize.cpp).

- Each tensor it quantizes looks its entry up by its GGUF name. No entry: quantized without one
  (llama.cpp says "did not find weights"), unless its type needs one (`requires_imatrix`:
  IQ1/IQ2/IQ3_XXS, Q2_K in a Q2_K_S file), which llama.cpp refuses, and so does qtool.
- An entry holds columns × experts values (ne[0] * ne[2]); a 3-D expert tensor's rows of expert
  e take the e-th slice. Any other size is an error, except for token_embd (llama.cpp quantizes
  it without one). qtool also refuses an imatrix none of whose entries names a tensor it
  quantizes: one made for another model, which llama.cpp would apply to nothing.
- The output records it in four key-values, as llama-quantize's kv overrides write them:
  quantize.imatrix.file (the path as given), .dataset (the first dataset), .entries_count,
  .chunks_count (when above 0); strings cut to 127 bytes as its `strncpy` cuts them.

The importance itself (sums / counts per expert) is `qtool.formats.imatrix.ImatrixEntry`'s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from qtool.errors import ImatrixError, SchemeError
from qtool.llamacpp.mixes import requires_imatrix
from qtool.plan import QUANTIZE, GgmlBlocks, Job

if TYPE_CHECKING:
    from qtool.formats.imatrix import Imatrix

__all__ = ["attach_importance", "imatrix_metadata", "IMATRIX_KEYS"]

IMATRIX_KEYS = (
    "quantize.imatrix.file",
    "quantize.imatrix.dataset",
    "quantize.imatrix.entries_count",
    "quantize.imatrix.chunks_count",
)
_KV_STRING_BYTES = 127  # llama_model_kv_override.val_str is char[128]
_TOKEN_EMBD = ("token_embd.weight", "per_layer_token_embd.weight")


def attach_importance(jobs: list[Job], imatrix: Imatrix | None, mix: str | None) -> tuple[list[Job], list[str]]:
    """The jobs again, each quantized one's GgmlBlocks.importance from `imatrix` (float32
    [columns], or [experts, columns]); refuse what llama-quantize refuses. Returns the new jobs
    (the given ones are not changed) and notes for the plan."""
    quantized = [job for job in jobs if job.action == QUANTIZE and isinstance(job.encoding, GgmlBlocks)]
    if imatrix is None:
        for job in quantized:
            out = job.outputs[0]
            if requires_imatrix(out.name, job.encoding.type, mix):
                raise SchemeError(
                    f"{out.name}: {out.dtype} needs an importance matrix (llama.cpp refuses it without one)",
                    hint="give an importance matrix (llama-imatrix's or qtool imatrix's) or calibration text, or pick a type of 3 bits or more",
                    option="imatrix",
                )
        return list(jobs), []
    missing: list[str] = []
    used = 0
    weighted: dict[int, Job] = {}
    for job in quantized:
        out = job.outputs[0]
        shape = tuple(job.weight.shape)
        columns, experts = shape[-1], shape[0] if len(shape) >= 3 else 1
        entry = imatrix.entries.get(out.name)
        if entry is None or (entry.values != columns * experts and out.name in _TOKEN_EMBD):
            if requires_imatrix(out.name, job.encoding.type, mix):
                raise ImatrixError(
                    f"has no entry for {out.name}, whose type {out.dtype} needs one (llama.cpp refuses it)",
                    path=imatrix.path,
                    hint="make the imatrix from this model",
                )
            missing.append(out.name)
            continue
        if entry.values != columns * experts:
            raise ImatrixError(
                f"entry {out.name} holds {entry.values} values, the weight has {columns} columns"
                + (f" × {experts} experts" if experts > 1 else "")
                + ": an importance matrix for another model?",
                path=imatrix.path,
                hint="make the imatrix from this model (llama-imatrix, or qtool imatrix)",
            )
        importance = entry.importance()
        weighted[id(job)] = replace(
            job,
            encoding=GgmlBlocks(
                job.encoding.type, importance.reshape(experts, columns) if len(shape) >= 3 else importance
            ),
        )
        used += 1
    if quantized and not used:
        raise ImatrixError(
            f"none of its {len(imatrix.entries)} entries (e.g. {next(iter(imatrix.entries))}) names a tensor this quantizes (e.g. {quantized[0].outputs[0].name}): an importance matrix for another model?",
            path=imatrix.path,
            hint="make the imatrix from this model (llama-imatrix, or qtool imatrix)",
        )
    notes = [f"importance matrix {imatrix.path}: {used} of {len(quantized)} quantized tensors weighted by it"]
    if missing:
        notes.append(
            f"{len(missing)} quantized tensors have no entry in it and are quantized without one, as llama-quantize does (e.g. {missing[0]})"
        )
    return [weighted.get(id(job), job) for job in jobs], notes


def imatrix_metadata(imatrix: Imatrix, file_name: str) -> list[tuple[str, Any, str]]:
    """The key-values llama-quantize adds for an imatrix, in its order: (key, value, type)."""
    entries: list[tuple[str, Any, str]] = [
        (IMATRIX_KEYS[0], _c_string(file_name.encode("utf-8", "surrogateescape")), "STRING")
    ]
    if imatrix.datasets:
        entries.append((IMATRIX_KEYS[1], _c_string(imatrix.datasets[0]), "STRING"))
    entries.append((IMATRIX_KEYS[2], len(imatrix.entries), "UINT32"))
    if imatrix.chunk_count > 0:
        entries.append((IMATRIX_KEYS[3], imatrix.chunk_count, "UINT32"))
    return entries


def _c_string(raw: bytes) -> bytes:
    """What strncpy(val_str, s, 127) keeps: up to the first NUL, at most 127 bytes."""
    return raw.split(b"\0", 1)[0][:_KV_STRING_BYTES]
