"""`qtool imatrix`: llama.cpp's importance matrix of a Hugging Face model on a text, written as
llama-imatrix writes it. Planned as a quantization is (paths refused before anything is read,
the preconditions every calibrated run shares), then computed on the calibration runner's
layers (`qtool.calibration.imatrix`) and staged atomically."""

from __future__ import annotations

import os
from typing import Any
from collections.abc import Callable

from qtool.errors import UsageError
from qtool.formats import open_checkpoint
from qtool.inspection import inspect_checkpoint
from qtool.planning.paths import check_paths, refuse_remote_data
from qtool.planning.preconditions import ready, require_float_model

__all__ = ["compute_imatrix"]


def compute_imatrix(
    path: str | os.PathLike[str],
    output: str,
    text: str,
    *,
    chunks: int | None,
    chunk_size: int,
    device: str,
    threads: int | None,
    overwrite: bool,
    allow_incomplete_gguf: bool,
    on_layer: Callable[[Any, int], None] | None,
    on_start: Callable[[int, int, int], None] | None,
) -> dict[str, Any]:
    """What `qtool.api.imatrix` documents; returns the `--json` document."""
    from qtool.calibration.imatrix import as_imatrix, chunk_tokens, collect_imatrix, statistics_entries
    from qtool.formats.imatrix import imatrix_gguf_bytes
    from qtool.formats.transformers_boundary import collected
    from qtool.formats.writer import stage_file
    from qtool.llamacpp.names import tensor_names
    from qtool.pipeline import kernel_threads, resolve_device

    if not output.endswith(".gguf"):
        raise UsageError(
            f"{output}: an importance matrix is written as GGUF and its name should end in .gguf",
            hint="e.g. imatrix.gguf",
            option="output",
        )
    if threads is not None and threads < 1:
        raise UsageError(f"threads {threads} must be at least 1", option="threads")
    refuse_remote_data(path)
    checkpoint = open_checkpoint(path)
    try:
        checkpoint.require_local()
        require_float_model(checkpoint, [], shown=os.fspath(path), imatrix_command=True)
        check_paths(checkpoint, output, None, container="gguf")
        if os.path.realpath(output) == os.path.realpath(text) or os.path.realpath(text).startswith(
            os.path.realpath(output) + os.sep
        ):
            raise UsageError(f"output {output} is the calibration text", hint="write to a new path")
        if os.path.lexists(output) and not overwrite:
            raise UsageError(
                f"output {output} already exists",
                hint="allow overwriting to replace it, or choose another path",
                option="overwrite",
            )
        names = tensor_names(checkpoint, allow_incomplete_gguf)
        weights = inspect_checkpoint(checkpoint).weights
        require_float_model(checkpoint, weights, shown=os.fspath(path), imatrix_command=True)
        readied = ready(checkpoint, text)
        said = list(readied.notes)  # what transformers and torch say: the document's warnings
        tokens = chunk_tokens(readied.text, readied.tokenizer, chunk_size, chunks, text)
        if on_start is not None:
            on_start(int(tokens.shape[0]), int(tokens.shape[1]), readied.layers)
        with kernel_threads(threads), collected(said, "calibration: "):
            stats = collect_imatrix(
                checkpoint,
                weights,
                names.tensor_name,
                tokens,
                resolve_device(device),
                on_layer,
                skeleton=readied.skeleton,
            )
    finally:
        checkpoint.close()
    staged = stage_file(
        output,
        imatrix_gguf_bytes(statistics_entries(stats), [text], stats.chunks, stats.chunk_size),
        overwrite=overwrite,
    )
    staged.commit()
    document = as_imatrix(stats, output, text).to_json()
    return {
        **document,
        "text": text,
        "seconds": round(stats.seconds, 3),
        "layers": [layer.to_json() for layer in stats.layers],
    } | ({"warnings": said} if said else {})
