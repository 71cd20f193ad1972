"""What `quantize` and `dequantize` share: showing a plan, and running it with a progress bar."""

from __future__ import annotations

from typing import Any

from qtool.cli.output import Column, Output, Rows, Section, print_warning, progress
from qtool.cli.text import human_bytes


def show_plan(task, output: Output) -> None:
    document = task.plan.to_json()
    document["output"] = task.output
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
            ["layout", document["format"]],
            ["files", ", ".join(document["files"])],
        ],
        show_header=False,
    )
    output.emit(document, rows, [facts])


def run_task(task, *, device: str, threads: int | None, overwrite: bool, quiet: bool, measure: bool):
    from qtool import api

    for warning in task.warnings:
        print_warning(warning)
    total = sum(job.bytes_in for job in task.plan.jobs)
    with progress("writing" if not measure else "quantizing", total, quiet) as advance:
        return api.run(task, device=device, threads=threads, overwrite=overwrite, on_progress=advance, measure=measure)


def report_json(task, result, device: str) -> dict[str, Any]:
    """The `--report` document: every quantized weight's error against the original."""
    model = result.model_error()
    plan = task.plan.to_json()
    by_name = {w["name"]: w for w in plan["weights"]}
    weights = []
    for name, stats in result.errors.items():
        entry = by_name[name]
        weights.append(
            {
                "name": name,
                "scheme": entry["scheme"],
                "shape": entry["shape"],
                "bytes_before": entry["bytes_before"],
                "bytes_after": entry["bytes_after"],
                **stats.to_json(),
            }
        )
    weights.sort(key=lambda w: (w["sqnr_db"] is None, w["sqnr_db"] if w["sqnr_db"] is not None else 0.0))
    return {
        "schema_version": 1,
        "input": task.plan.source.path,
        "output": task.output,
        "device": device,
        "seconds": round(result.seconds, 3),
        "summary": {**plan["summary"], **model.to_json()},
        "weights": weights,
    }
