"""Where a write may go: every path qtool would write refused, before anything is read or
written, when it is, or lies inside, a path it reads; and the warnings of what a folder output
leaves behind. One place for `quantize`, `dequantize` and `imatrix`."""

from __future__ import annotations

import os

from qtool.errors import UsageError
from qtool.formats import Checkpoint

__all__ = ["refuse_remote_data", "check_paths", "refuse_linked_config", "side_file_warnings"]


def refuse_remote_data(path: str | os.PathLike[str]) -> None:
    """A command that reads tensor data refuses a remote location before it opens it: the same
    refusal (and download command) as after, with no request, so offline too."""
    if isinstance(path, str) and path.startswith(("hf://", "http://", "https://")):
        from qtool.formats.remote_loader import refuse_remote_data as refuse

        refuse(path)


def check_paths(checkpoint: Checkpoint, output: str, report: str | None, *, container: str) -> bool:
    """Refuse, before anything is written, every path qtool would write that is, or lies
    inside, one it reads, and a report that is the output or inside it. Returns whether the
    output is a single file."""
    from qtool.formats.loader import input_paths

    inputs = input_paths(checkpoint)

    def clash(path: str, what: str) -> None:
        real = os.path.realpath(path)
        if real in inputs:
            raise UsageError(
                f"{what} {path} is the input {real}", hint="write to a new path; qtool never modifies its input"
            )
        for source in inputs:
            if real.startswith(source.rstrip(os.sep) + os.sep):
                raise UsageError(
                    f"{what} {path} lies inside the input {source}", hint="write beside the input, not into it"
                )

    for path, what in ((output, "output"), (report, "report")):
        if path is not None and not path.strip():
            raise UsageError(f"the {what} path is empty", option=what)
    clash(output, "output")
    real_out = os.path.realpath(output)
    for source in inputs:  # an --overwrite of a folder holding the input would replace the input
        if source.startswith(real_out.rstrip(os.sep) + os.sep):
            raise UsageError(
                f"output {output} holds the input {source}", hint="write to a new path; qtool never modifies its input"
            )
    single_file = output.endswith((".safetensors", ".gguf"))
    if container == "gguf" and not output.endswith(".gguf"):
        raise UsageError(f"a GGUF output is one file: {output} should end in .gguf", hint="e.g. model-q4_0.gguf")
    if container != "gguf" and output.endswith(".gguf"):
        raise UsageError(
            f"{output} ends in .gguf, but this writes {container}",
            hint="name a folder or a .safetensors file, or quantize to a GGUF scheme (q8_0, q4_0, ...)",
        )
    if not single_file:  # only a folder output gets config.json copied into it
        refuse_linked_config(checkpoint)
    if report is not None:
        clash(report, "report")
        real_out, real_report = os.path.realpath(output), os.path.realpath(report)
        if real_report == real_out or real_report.startswith(real_out + os.sep):
            raise UsageError(
                f"report {report} would be inside the output {output}", hint="write the report beside the output"
            )
    return single_file


def refuse_linked_config(checkpoint: Checkpoint) -> None:
    """config.json is rewritten into the output: one that links out of the model's folder (an
    HF cache's blobs aside) would publish whatever it points at."""
    from qtool.side_files import linked_out

    for file in {os.path.join(os.path.dirname(f), "config.json") for f in checkpoint.files}:
        if linked_out(file):
            raise UsageError(
                f"{file} links out of the model folder, to {os.path.realpath(file)}",
                hint="copy the real config.json into the model folder; qtool will not publish a linked one",
            )


def side_file_warnings(checkpoint: Checkpoint, single_file: bool) -> list[str]:
    """The checkpoint's own notes, and (a folder output) each side file it does not carry over."""
    from qtool.side_files import skipped_links

    if single_file:
        return list(checkpoint.notes)
    return [*checkpoint.notes] + [
        f"{name} is not copied: it links out of the model folder, is not a regular file, or is too large"
        for name in skipped_links(checkpoint)
    ]
