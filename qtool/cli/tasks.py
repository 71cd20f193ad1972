"""What `quantize` and `dequantize` share: showing a plan, and running it with a progress bar.

Process-wide settings a run benefits from (glibc's heap thresholds, the OpenMP pool size torch
reads when it is first imported) are made here, in the CLI, never by the library.
"""

from __future__ import annotations

import os

from qtool.cli.output import Column, Output, Rows, Section, print_warning, progress
from qtool.cli.text import human_bytes


def show_plan(task, output: Output) -> None:
    document = task.to_json()
    rows = Rows(
        [
            Column("name"),
            Column("action"),
            Column("scheme", human=lambda v: v or "—"),
            Column("from", human=lambda v: v or "—"),
            Column("shape"),
            Column("before", human=human_bytes, justify="right"),
            Column("after", human=human_bytes, justify="right"),
            Column("bits/weight", human=lambda v: f"{v:.3f}", justify="right"),
        ],
        [
            [w["name"], w["action"], w["scheme"], w["from"], w["shape"], w["bytes_before"], w["bytes_after"], w["bits_per_weight"]]
            for w in document["weights"]
        ],
        collapse_keys=(1, 2, 3, 4, 7),
        collapse_sums=(5, 6),
        title=f"Plan: {task.output}",
    )
    summary = document["summary"]
    facts = Section(
        "Total",
        [Column("fact"), Column("value", justify="right")],
        [
            ["weights", f"{summary['weights']} ({summary['quantized_weights']} quantized)"],
            ["before", human_bytes(summary["bytes_before"])],
            ["after", human_bytes(summary["bytes_after"])],
            ["bits per weight", f"{summary['bits_per_weight']:.3f}"],
            ["layout", document["layout"]],
            ["files", ", ".join(document["files"])],
        ],
        show_header=False,
    )
    output.emit(document, rows, [facts])


def _keep_freed_memory() -> None:
    """Ask glibc to serve and keep large blocks from its heap. By default every chunk-sized
    temporary is a fresh mmap, returned on free and page-faulted in again on the next chunk:
    on a 2-core machine that was ~40% of a quantize run, as system time. Peak RSS is unchanged:
    the same few chunk-sized blocks are reused."""
    import ctypes

    from qtool import libc

    mallopt = libc.function("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None:  # not glibc (musl, ...): keep its defaults
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 256 << 20)
    mallopt(m_trim_threshold, 1 << 30)


def run_task(task, *, device: str, threads: int | None, overwrite: bool, quiet: bool, measure: bool):
    from qtool import api
    from qtool.pipeline import ExecOptions

    for warning in task.warnings:
        print_warning(warning)
    _keep_freed_memory()
    if threads and "torch" not in __import__("sys").modules:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # torch sizes its pool from this if a job imports it
    total = sum(job.bytes_in for job in task.plan.jobs)
    with progress("writing" if not measure else "quantizing", total, quiet) as advance:
        return api.run(task, ExecOptions(device=device, threads=threads, measure=measure, on_progress=advance), overwrite=overwrite)
