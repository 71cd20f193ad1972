"""`qtool convert IN -o OUT --to hf`: a GGUF back to the Hugging Face model folder it came from,
planned before anything is read or written.

The folder is what `from_pretrained` loads:

    model.safetensors   every weight decoded to `dtype` (float32 by default: each value is the
                        float32 llama.cpp's own dequantization gives), under its Hugging Face name,
                        a llama's q/k rows back in Hugging Face's order (the plan `dequantize`
                        makes, `PlanOptions.hugging_face_names`; sharded as it shards)
    config.json         from the GGUF's metadata (`qtool.evaluation.gguf_model`), `dtype` and
                        `torch_dtype` saying what the weights are
    tokenizer files     the GGUF's vocabulary as transformers' tokenizer, `save_pretrained` as
                        transformers writes it (tokenizer.json, tokenizer_config.json with the
                        GGUF's chat template), rendered here, while planning, so that a vocabulary
                        transformers refuses is refused before anything is written
    generation_config   the BOS and EOS ids, where the GGUF states them

A checkpoint that is not a GGUF has its Hugging Face names already: converting it to hf is
`qtool dequantize`'s plan (its config and tokenizer travel), every weight decoded to `dtype`.
The other targets the issue names are refused in one line until they are built.

Whether each weight is exact (its written values the input's float32 values bit for bit) is
known here where the target holds every value (float32 holds every decoded and every float
value; a copy is its own bytes); a narrower dtype is measured while it is written
(`qtool.pipeline.ExecOptions.exactness`) and reported (`qtool.reports.ConvertReport`,
`exact_by_construction`).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

from qtool.errors import CheckpointError, UsageError
from qtool.formats import open_checkpoint
from qtool.inspection import inspect_checkpoint
from qtool.plan import Plan
from qtool.planning.paths import check_paths, refuse_remote_data, side_file_warnings

__all__ = ["TARGETS", "WRITTEN_TARGETS", "plan_convert"]

TARGETS = ("hf", "compressed-tensors", "gguf", "mlx", "bitsandbytes")  # what issue 39 names
WRITTEN_TARGETS = ("hf",)  # what is built
_TORCH_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # config.json's dtype spelling
_TOKENIZER_FILE_LIMIT = 64 << 20  # as qtool.side_files.SIDE_FILE_LIMIT: a tokenizer is a few MB


def plan_convert(path: str | os.PathLike[str], output: str, to: str, dtype: str, max_shard_size: str | None) -> Plan:
    """The plan of `convert` (see the module's docstring); its checkpoint open, as a quantize
    plan's (the run closes it; a refusal here does)."""
    from qtool.pipeline import parse_dtype

    if to not in TARGETS:
        raise UsageError(
            f"target {to!r} is not a format qtool converts to", hint=f"use one of {', '.join(TARGETS)}", option="to"
        )
    if to not in WRITTEN_TARGETS:
        raise UsageError(
            f"converting to {to} is not built yet", hint="convert to hf (a Hugging Face model folder)", option="to"
        )
    if output.endswith((".safetensors", ".gguf")):
        raise UsageError(
            f"a Hugging Face model is a folder: {output} names a file",
            hint="name a folder, e.g. model-hf/",
            option="output",
        )
    out_dtype = parse_dtype(dtype)
    refuse_remote_data(path)
    checkpoint = open_checkpoint(path)
    try:
        checkpoint.require_local()
        if checkpoint.format != "gguf":
            return _dequantized(checkpoint, os.fspath(path), output, out_dtype, max_shard_size)
        return _from_gguf(checkpoint, output, out_dtype, max_shard_size)
    except BaseException:
        checkpoint.close()
        raise


def _with_dtype(config: dict[str, Any] | None, out_dtype: str) -> dict[str, Any]:
    """config.json saying what the weights are: `dtype` (transformers 5) and `torch_dtype`
    (what transformers 4 reads)."""
    return {**(config or {}), "dtype": _TORCH_NAMES[out_dtype], "torch_dtype": _TORCH_NAMES[out_dtype]}


def _dequantized(checkpoint, path: str, output: str, out_dtype: str, max_shard_size: str | None) -> Plan:
    """A checkpoint with Hugging Face names already: `dequantize`'s plan, every float weight
    written as `out_dtype`, its config and tokenizer carried over."""
    from qtool.planning.quantize import plan_dequantize

    checkpoint.close()  # dequantize opens its own
    plan = plan_dequantize(path, output, out_dtype, max_shard_size)
    return replace(plan, config=_with_dtype(plan.config, out_dtype))


def _from_gguf(checkpoint, output: str, out_dtype: str, max_shard_size: str | None) -> Plan:
    from qtool.evaluation.gguf_model import gguf_as_hugging_face
    from qtool.layouts import LAYOUTS
    from qtool.pipeline import parse_size
    from qtool.plan import Chosen, PlanOptions

    view = gguf_as_hugging_face(checkpoint)  # an unmapped architecture, a missing key: refused here
    notes: list[str] = []
    tokenizer = view.tokenizer(notes)
    check_paths(checkpoint, output, None, container="safetensors")
    options = PlanOptions(
        single_file=False,
        out_dtype=out_dtype,
        max_shard_size=parse_size(max_shard_size) if max_shard_size else None,
        hugging_face_names=True,
    )
    weights = inspect_checkpoint(checkpoint).weights
    plan = LAYOUTS["safetensors"].plan(checkpoint, weights, Chosen(), options)
    config = _with_dtype(view.checkpoint.config, out_dtype)
    files = _tokenizer_files(tokenizer, checkpoint.path)
    generation = {name: config[name] for name in ("bos_token_id", "eos_token_id") if name in config}
    if generation:
        files.append(("generation_config.json", (json.dumps(generation, indent=2) + "\n").encode()))
    taken = set(LAYOUTS["safetensors"].side_files(plan)) | {"config.json", *plan.files}
    clash = [name for name, _ in files if name in taken]
    if clash:  # transformers wrote a file the weights or the config take
        raise CheckpointError(
            f"its tokenizer would be written as {clash[0]}, a file of the model itself", path=checkpoint.path
        )
    warnings = [*notes, *side_file_warnings(checkpoint, True)]
    return replace(plan, output=output, config=config, side_bytes=tuple(files), warnings=tuple(warnings))


def _tokenizer_files(tokenizer: Any, path: str) -> list[tuple[str, bytes]]:
    """The files `tokenizer.save_pretrained` writes, as (name, bytes), sorted by name: written
    into a temporary folder and read back now, so the run only copies bytes."""
    import tempfile

    from qtool.formats.regular_files import NotReadable, read_regular
    from qtool.formats.transformers_boundary import collected

    with tempfile.TemporaryDirectory(prefix="qtool-tokenizer-") as folder:
        notes: list[str] = []
        try:
            with collected(notes, "transformers: "):
                tokenizer.save_pretrained(folder)
        except OSError as exc:
            raise UsageError(
                f"cannot write the tokenizer's files into a temporary folder: {exc.strerror or exc}"
            ) from None
        files = []
        for name in sorted(os.listdir(folder)):
            try:
                data = read_regular(os.path.join(folder, name), _TOKENIZER_FILE_LIMIT)
            except NotReadable as exc:
                raise CheckpointError(f"its tokenizer's {name} cannot be written: {exc}", path=path) from None
            if len(data) > _TOKENIZER_FILE_LIMIT:
                raise CheckpointError(f"its tokenizer's {name} is over {_TOKENIZER_FILE_LIMIT >> 20} MiB", path=path)
            files.append((name, data))
    return files
