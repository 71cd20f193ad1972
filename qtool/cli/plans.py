"""What `quantize` and `dequantize` share: showing a plan, and running it with a progress bar.

Process-wide settings a run benefits from (glibc's heap thresholds, the OpenMP pool size torch
reads when it is first imported) are made here, in the CLI, never by the library.
"""

from __future__ import annotations

import os

from qtool.cli.output import Column, Output, Rows, Section, print_status, print_warning, progress
from qtool.cli.text import human_bytes


def show_plan(plan, output: Output) -> None:
    document = plan.to_json()
    if document["layout"] == "gguf":
        return _show_gguf_plan(plan, document, output)
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
            [
                w["name"],
                w["action"],
                w["scheme"],
                w["from"],
                w["shape"],
                w["bytes_before"],
                w["bytes_after"],
                w["bits_per_weight"],
            ]
            for w in document["weights"]
        ],
        collapse_keys=(1, 2, 3, 4, 7),
        collapse_sums=(5, 6),
        title=f"Plan: {plan.output}",
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


def _show_gguf_plan(plan, document: dict, output: Output) -> None:
    """A GGUF plan as llama-quantize prints one: each tensor in file order, its type before and
    after, its size before and after; then the totals and each row-length fallback."""
    rows = Rows(
        [
            Column("tensor"),
            Column("shape"),
            Column("type", human=lambda v: v),
            Column("before", human=human_bytes, justify="right"),
            Column("after", human=human_bytes, justify="right"),
            Column("bits/weight", human=lambda v: f"{v:.3f}", justify="right"),
        ],
        [
            [
                w["tensors"][0]["name"],
                w["shape"],
                w["stored_as"]
                if w["stored_as"] == w["tensors"][0]["dtype"]
                else f"{w['stored_as']} -> {w['tensors'][0]['dtype']}",
                w["bytes_before"],
                w["bytes_after"],
                w["bits_per_weight"],
            ]
            for w in document["weights"]
        ],
        title=f"Plan: {plan.output}",
    )
    summary = document["summary"]
    by_type: dict[str, int] = {}
    for w in document["weights"]:
        by_type[w["tensors"][0]["dtype"]] = by_type.get(w["tensors"][0]["dtype"], 0) + 1
    facts = [
        ["tensors", f"{summary['weights']} ({summary['quantized_weights']} quantized)"],
        ["types", ", ".join(f"{name} {count}" for name, count in sorted(by_type.items(), key=lambda kv: -kv[1]))],
        ["before", human_bytes(summary["bytes_before"])],
        ["after", human_bytes(summary["bytes_after"])],
        ["bits per weight", f"{summary['bits_per_weight']:.3f}"],
        ["file", ", ".join(document["files"])],
    ]
    sections = [Section("Total", [Column("fact"), Column("value", justify="right")], facts, show_header=False)]
    if document["notes"]:
        sections.append(
            Section("Fallbacks", [Column("note")], [[note] for note in document["notes"]], show_header=False)
        )
    output.emit(document, rows, sections)


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


def worker_setup() -> None:
    """What each worker process of a spread run sets for itself, as `run_plan` does here."""
    _keep_freed_memory()


def _pool_warning(pool) -> str:
    """One line: how many worker processes start instead of --workers, and what capped them."""
    from qtool.cli.text import human_bytes

    said = f"--workers {pool.requested}: starting {pool.workers} worker process{'es' if pool.workers != 1 else ''}"
    if pool.by_memory:
        return f"{said}: memory for {pool.workers} at about {human_bytes(pool.per_worker)} each ({human_bytes(pool.available)} available; {pool.jobs} shard jobs)"
    return f"{said}, one per shard job"


def run_plan(
    plan,
    *,
    device: str,
    threads: int | None,
    overwrite: bool,
    quiet: bool,
    measure: bool,
    spread: tuple = (1, "local", None, None),
):
    """`spread`: (workers, executor, ray address, max retries), as `api.run` takes them."""
    from qtool import api

    workers, executor, ray_address, max_retries = spread
    for warning in plan.warnings:
        print_warning(warning)
    _keep_freed_memory()
    if executor == "local" and workers > 1:  # spawned workers inherit it: each gets its share
        pool = api.worker_pool(plan, workers)  # api.run starts this many (the same sums)
        if pool.capped:
            print_warning(_pool_warning(pool))
        os.environ["OMP_NUM_THREADS"] = str(max(1, (threads or os.cpu_count() or 1) // pool.workers))
    elif threads and "torch" not in __import__("sys").modules:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # torch sizes its pool from this if a job imports it
    total = sum(job.bytes_in for job in plan.jobs)

    def layer_done(layer, layers: int) -> None:
        error = getattr(layer, "output_error", None)  # an importance matrix quantizes nothing while it runs
        print_status(
            f"calibrated layer {layer.index + 1}/{layers} in {layer.seconds:.1f} s"
            + (f", output relative MSE {error:.3g}" if error is not None else ""),
            quiet,
        )

    spread_out = workers > 1 or executor != "local"  # then each progress call is one shard job done
    with progress(
        "writing" if not measure else "quantizing", total, quiet, count="shard jobs" if spread_out else None
    ) as advance:
        outcome = api.run(
            plan,
            device=device,
            threads=threads,
            measure=measure,
            on_progress=advance,
            overwrite=overwrite,
            on_layer=layer_done,
            workers=workers,
            executor=executor,
            ray_address=ray_address,
            max_retries=max_retries,
            worker_setup=worker_setup if (workers > 1 or executor != "local") else None,
        )
    for warning in (outcome.calibration or {}).get("warnings", ()):  # transformers' and torch's talk while calibrating
        print_warning(warning)
    decoded = {job.weight.name for job in plan.jobs if job.action == "dequantize"}
    for name, value in sorted(outcome.measured.non_finite.items()):
        if name in decoded:  # the read side's rule is the write side's: said, by name, never silent
            print_warning(f"{name} decodes to {value} values: written as they decode (see `qtool check --no-nan`)")
        else:
            print_warning(
                f"{name} holds {value} values: encoded as its toolchain does, no error figure (see `qtool check --no-nan`)"
            )
    return outcome
