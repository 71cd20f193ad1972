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
WRITTEN_TARGETS = ("hf", "compressed-tensors", "gguf")  # what is built
_TORCH_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # config.json's dtype spelling
_TOKENIZER_FILE_LIMIT = 64 << 20  # as qtool.side_files.SIDE_FILE_LIMIT: a tokenizer is a few MB


def plan_convert(
    path: str | os.PathLike[str],
    output: str,
    to: str,
    dtype: str,
    max_shard_size: str | None,
    requantize: str | None = None,
) -> Plan:
    """The plan of `convert` (see the module's docstring); its checkpoint open, as a quantize
    plan's (the run closes it; a refusal here does). `requantize` (compressed-tensors only): the
    scheme a weight whose codes cannot move is decoded and quantized again with ("auto": int4
    groups of 32 with zero points for a source of 4 bits or fewer, int8 groups of 32 above),
    instead of refusing it."""
    from qtool.pipeline import parse_dtype

    if to not in TARGETS:
        raise UsageError(
            f"target {to!r} is not a format qtool converts to", hint=f"use one of {', '.join(TARGETS)}", option="to"
        )
    if to not in WRITTEN_TARGETS:
        raise UsageError(
            f"converting to {to} is not built yet", hint="convert to hf (a Hugging Face model folder)", option="to"
        )
    if requantize is not None and to != "compressed-tensors":
        raise UsageError(
            f"requantizing what cannot move is built for compressed-tensors, not {to}",
            hint="qtool quantize, with requantizing allowed, takes a quantized model to any scheme",
            option="allow_requantize",
        )
    if to == "gguf":
        if not output.endswith(".gguf"):
            raise UsageError(f"{output}: a GGUF is one file, and its name should end in .gguf", option="output")
        refuse_remote_data(path)
        checkpoint = open_checkpoint(path)
        try:
            checkpoint.require_local()
            return _moved_to_gguf(checkpoint, output)
        except BaseException:
            checkpoint.close()
            raise
    if output.endswith((".safetensors", ".gguf")):
        raise UsageError(
            f"a Hugging Face model is a folder: {output} names a file",
            hint="name a folder, e.g. model-hf/",
            option="output",
        )
    if to == "compressed-tensors":
        refuse_remote_data(path)
        checkpoint = open_checkpoint(path)
        try:
            checkpoint.require_local()
            return _moved(checkpoint, output, max_shard_size, requantize)
        except BaseException:
            checkpoint.close()
            raise
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


# -- codes moved as they are ------------------------------------------------------------------


def _moved_scheme(weight, model_dtype: str):
    """The compressed-tensors scheme a quantized weight's own grid becomes (its bits, group and
    symmetry; scales in the model dtype), or why its codes cannot move: no integer grid qtool
    reads out (`codes`), or a GGUF type whose blocks hold more than codes and one scale."""
    from qtool.conventions import convention_named
    from qtool.ggml_types import ggml_type_named
    from qtool.qtypes import qtype
    from qtool.scheme import CHANNEL, QScheme, group

    scheme = weight.scheme
    convention = convention_named(weight.convention)
    if convention is None or not hasattr(convention, "codes") or scheme.qtype.kind not in ("int", "uint"):
        return f"its {scheme.label} ({weight.convention}) is not an integer grid qtool moves"
    encoding = weight.data.encoding
    if encoding is not None:
        try:
            plain = ggml_type_named(encoding).plain_grid
        except KeyError:
            plain = False
        if not plain:
            from qtool.ggml_types import GGML_TYPES

            moved = ", ".join(row.name for row in GGML_TYPES.values() if row.plain_grid)
            return f"its GGUF {encoding} blocks are not one of the grids qtool moves as they are ({moved})"
    bits = scheme.qtype.bits
    block = CHANNEL if scheme.granularity == "channel" else group(scheme.group_size)
    return QScheme(qtype(f"int{bits}"), block, scheme.symmetric, model_dtype, zero_point=not scheme.symmetric)


def _model_dtype(checkpoint, weights) -> str:
    """The dtype of the compressed-tensors model: the one its loader dequantizes in, so it must
    be the source's own arithmetic (`IntCodes.arithmetic`): float32 for a GGUF (ggml widens its
    float16 scales), else the quantized weights' scale dtype (float16 for GPTQ and AWQ)."""
    if checkpoint.format == "gguf":
        return "F32"
    scales = {
        member.dtype.name
        for weight in weights
        if weight.quantized
        for role, member in weight.members.items()
        if role == "scale"
    }
    return scales.pop() if len(scales) == 1 else "F16"


def _refuse_unmoved(path: str, refused: list[tuple[str, str]], verb: str, hint: str) -> None:
    """One line for the weights whose codes cannot move: the first named with why, the rest counted."""
    if not refused:
        return
    name, why = refused[0]
    more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
    raise UsageError(f"{path}: {name} {verb}: {why}{more}", hint=hint, option="to")


def _requantized_scheme(weight, requantize: str):
    """The scheme a weight whose codes cannot move is quantized again with."""
    from qtool.scheme_strings import parse_scheme

    if requantize != "auto":
        return parse_scheme(requantize)
    return parse_scheme("int4:g32:asym" if weight.scheme.qtype.bits <= 4 else "int8:g32")


def _moved(checkpoint, output: str, max_shard_size: str | None, requantize: str | None = None) -> Plan:
    """Every quantized weight's codes, scales and zero points moved into compressed-tensors'
    pack-quantized tensors as they are (`qtool.plan.Moved`), every other tensor copied; a GGUF
    read under its Hugging Face names (q/k rows put back), with its config and tokenizer. A
    weight whose grid compressed-tensors cannot hold is refused here, before anything is read
    (or, with `requantize`, decoded and quantized again: its job keeps the layout's own
    encoding); one whose values would not come back bit for bit is refused when it is moved."""
    from qtool.layouts import LAYOUTS
    from qtool.layouts.moves import ToCompressedTensors
    from qtool.pipeline import parse_size
    from qtool.plan import QUANTIZE, Chosen, Moved, PlanOptions

    source, rows_back, files, notes = checkpoint, {}, [], []
    config = checkpoint.config
    if checkpoint.format == "gguf":
        from qtool.evaluation.gguf_model import gguf_as_hugging_face

        view = gguf_as_hugging_face(checkpoint)
        source, rows_back = view.checkpoint, dict(view.rows_back)
        files = _tokenizer_files(view.tokenizer(notes), checkpoint.path)
        config = view.checkpoint.config
    check_paths(checkpoint, output, None, container="safetensors")
    weights = inspect_checkpoint(source).weights
    model_dtype = _model_dtype(checkpoint, weights)
    schemes, refused, requantized = {}, [], set()
    for weight in weights:
        if weight.quantized:
            scheme = _moved_scheme(weight, model_dtype)
            if isinstance(scheme, str) and requantize is not None:
                scheme = _requantized_scheme(weight, requantize)
                requantized.add(weight.name)
            if isinstance(scheme, str):
                refused.append((weight.name, scheme))
            else:
                schemes[weight.name] = scheme
    _refuse_unmoved(
        checkpoint.path,
        refused,
        "cannot move exactly to compressed-tensors",
        "qtool moves GPTQ, AWQ, compressed-tensors int and GGUF Q4_0, Q4_1, Q8_0 codes; allow requantizing the rest",
    )
    options = PlanOptions(single_file=False, max_shard_size=parse_size(max_shard_size) if max_shard_size else None)
    plan = LAYOUTS["compressed-tensors"].plan(source, weights, Chosen(schemes), options)
    jobs = [
        replace(
            job,
            encoding=Moved(ToCompressedTensors(model_dtype, job.scheme.symmetric))
            if job.action == QUANTIZE and job.weight.name not in requantized
            else job.encoding,
            transform=rows_back.get(job.weight.name, job.transform),
        )
        for job in plan.jobs
    ]
    written = {
        **(plan.config or config or {}),
        "dtype": _TORCH_NAMES[model_dtype],
        "torch_dtype": _TORCH_NAMES[model_dtype],
    }
    warnings = [*notes, *side_file_warnings(checkpoint, True)]
    if requantized:
        count = len(requantized)
        warnings.append(
            f"{count} weight{'s' if count != 1 else ''} cannot move exactly: decoded and quantized again "
            "(each one's error in the report)"
        )
    return replace(plan, jobs=jobs, output=output, config=written, side_bytes=tuple(files), warnings=tuple(warnings))


def _gguf_type_of(weight) -> str:
    """The GGML type whose blocks hold a quantized weight's own grid (`qtool.layouts.moves`):
    symmetric 4-bit codes are Q4_0's (nibble = code + 8), symmetric 8-bit Q8_0's; codes with zero
    points (AWQ, asymmetric GPTQ) go to Q8_0, whose int8 holds code minus zero point for any
    grid of up to 7 bits (Q4_1 holds them only where d times the zero point is a float16, which
    few files give). Groups must be whole blocks of 32. Else why not."""
    from qtool.conventions import convention_named

    scheme = weight.scheme
    convention = convention_named(weight.convention)
    if convention is None or not hasattr(convention, "codes") or scheme.qtype.kind not in ("int", "uint"):
        return f"its {scheme.label} ({weight.convention}) is not an integer grid qtool moves"
    if weight.data.encoding is not None:
        return "it is a GGUF tensor already: convert a Hugging Face checkpoint"
    cols = weight.shape[-1] if weight.shape else 0
    group_size = cols if scheme.granularity == "channel" else scheme.group_size
    if not group_size or group_size % 32 or cols % 32:
        return f"its groups of {group_size} are not whole GGUF blocks of 32"
    bits = scheme.qtype.bits
    if scheme.symmetric and bits == 4:
        return "Q4_0"
    if (scheme.symmetric and bits == 8) or (not scheme.symmetric and bits <= 7):
        return "Q8_0"
    return f"{bits}-bit codes with zero points do not fit Q8_0's int8"


def _moved_to_gguf(checkpoint, output: str) -> Plan:
    """Every quantized weight's codes and scales written as GGUF blocks of the type whose grid
    holds them (`_gguf_type_of`), every other tensor as the gguf layout keeps it, named, permuted
    and described as `quantize -o x.gguf` does. Whether each weight is exact is measured: ggml
    forms each product in float32, where GPTQ, AWQ and compressed-tensors round it to their
    scales' float16, so the same codes and scales may decode a rounding apart."""
    from qtool.ggml_types import ggml_type_named
    from qtool.layouts import LAYOUTS
    from qtool.layouts.moves import ToGguf
    from qtool.plan import QUANTIZE, Chosen, Moved, PlanOptions

    if checkpoint.format == "gguf":
        raise UsageError(
            f"{checkpoint.path} is a GGUF already", hint="qtool quantize requantizes a GGUF to other types", option="to"
        )
    check_paths(checkpoint, output, None, container="gguf")
    weights = inspect_checkpoint(checkpoint).weights
    schemes, types, refused = {}, {}, []
    for weight in weights:
        if weight.quantized:
            chosen = _gguf_type_of(weight)
            if chosen not in ("Q4_0", "Q8_0"):
                refused.append((weight.name, chosen))
                continue
            types[weight.name] = chosen
            schemes[weight.name] = ggml_type_named(chosen).scheme
    _refuse_unmoved(
        checkpoint.path,
        refused,
        "cannot move to GGUF",
        "qtool moves GPTQ, AWQ and compressed-tensors int codes in groups of 32, 64, 128 ...",
    )
    plan = LAYOUTS["gguf"].plan(checkpoint, weights, Chosen(schemes), PlanOptions(single_file=True))
    jobs = [
        replace(job, encoding=Moved(ToGguf(types[job.weight.name], grid_only=True))) if job.action == QUANTIZE else job
        for job in plan.jobs
    ]
    return replace(plan, jobs=jobs, output=output, single_file=True)
