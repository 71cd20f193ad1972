"""What a quantize or dequantize run reports, as a value: the API builds it, `--json` prints it
and `--report` writes it, so a script gets the same document either way.

Two model-wide error figures, named for what they cover:
- `quantized`: over the quantized weights only (what quantizing cost where it was applied);
- `all_weights`: over every float weight written, the copied ones included as exact (what
  `qtool compare` reports as its summary for the same pair of checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

from qtool.error_measures import ErrorStats
from qtool.model_summary import describe_model
from qtool.plan import CAST, COPY, DEQUANTIZE, QUANTIZE, Moved
from qtool.sqnr_histogram import sqnr_histogram
from qtool.weight_position import weight_position

if TYPE_CHECKING:
    from qtool.pipeline import Measurements
    from qtool.plan import Job, Plan

__all__ = ["RunReport", "REPORT_SCHEMA_VERSION", "ConvertReport", "conversion_plan_document", "exact_by_construction"]

REPORT_SCHEMA_VERSION = 1
_PAST = {"quantize": "quantized", "dequantize": "dequantized", "copy": "copied", "cast": "cast"}


@dataclass(frozen=True)
class RunReport:
    plan: Plan
    measured: Measurements
    device: str
    execution: dict[str, Any] | None = (
        None  # a run spread over workers: the executor and each shard job (`qtool.spread.distribute`)
    )
    input_revision: bool | dict[str, Any] | None = (
        True  # the input's revision as `api.run` read it before the commit (True: look it up)
    )
    calibration: Mapping[str, Any] | None = (
        None  # what the plan's calibration stage did (`qtool.plan.Calibrated.document`); None: none ran
    )

    @property
    def errors(self) -> dict[str, ErrorStats]:
        """Per quantized weight, its error against the original."""
        return self.measured.errors

    @property
    def seconds(self) -> float:
        return self.measured.seconds

    def __repr__(self) -> str:
        """One line for a REPL: the dataclass's own repr spells out every plan job (40 KB)."""
        actions: dict[str, int] = {}
        for job in self.plan.jobs:
            actions[job.action] = actions.get(job.action, 0) + 1
        done = ", ".join(f"{count} {_PAST.get(action, action)}" for action, count in sorted(actions.items()))
        figure = f", all-weights SQNR {self.all_weights_error().sqnr_db:.2f} dB" if actions.get(QUANTIZE) else ""
        return f"<RunReport {self.plan.source.path} -> {self.plan.output} ({self.plan.layout.name}): {done}{figure}, {self.measured.seconds:.2f} s>"

    def model_error(self) -> ErrorStats:
        """Over the quantized weights only."""
        return self.measured.model_error()

    def all_weights_error(self) -> ErrorStats:
        """Over every float weight written, copies exact: `qtool compare`'s summary figure."""
        return self.measured.model_error().merge(self.measured.unquantized)

    def to_json(self) -> dict[str, Any]:
        plan = self.plan.to_json()
        by_name = {w["name"]: w for w in plan["weights"]}
        weights = []
        if any(j.action == QUANTIZE for j in self.plan.jobs):
            for name, stats in self.measured.errors.items():
                entry = by_name[name]
                weights.append(
                    {
                        "name": name,
                        "scheme": entry["scheme"],
                        "shape": entry["shape"],
                        "bytes_before": entry["bytes_before"],
                        "bytes_after": entry["bytes_after"],
                        **stats.to_json(),
                        # added for issue 23 (the HTML report)
                        **weight_position(name).to_json(),
                        "parameters": _parameters(entry["shape"]),
                        "non_finite_input": self.measured.non_finite.get(
                            name
                        ),  # added for issue 18: "NaN", "inf" or null
                    }
                )
            weights.sort(key=lambda w: (w["sqnr_db"] is None, w["sqnr_db"] if w["sqnr_db"] is not None else 0.0))
            summary = {
                **plan["summary"],
                **self.model_error().to_json(),  # schema 1: these top-level figures cover the quantized weights
                "quantized": self.model_error().to_json(),
                "all_weights": self.all_weights_error().to_json(),
                "histogram": sqnr_histogram(
                    stats.sqnr_db for stats in self.measured.errors.values()
                ),  # added for issue 23
                "non_finite_weights": sorted(self.measured.non_finite),  # added for issue 18: inputs holding inf/NaN
            }
        else:  # added for issue 42: weights whose decoded values hold inf/NaN, as quantize's inputs
            weights = [
                {**w, "non_finite_decoded": self.measured.non_finite.get(w["name"])}
                for w in plan["weights"]
                if w["action"] == "dequantize"
            ]
            summary = {**plan["summary"], "non_finite_weights": sorted(self.measured.non_finite)}
        return {
            "schema_version": REPORT_SCHEMA_VERSION,
            "input": self.plan.source.path,
            "output": self.plan.output,
            "layout": plan["layout"],
            "files": plan["files"],
            "device": self.device,
            "seconds": round(self.measured.seconds, 3),
            "summary": summary,
            "weights": weights,
            "models": self._models(plan),  # added for issue 23
            **({"execution": self.execution} if self.execution is not None else {}),  # added for issue 22
            **({"calibration": dict(self.calibration)} if self.calibration is not None else {}),  # added for issue 20
        }

    def _models(self, plan: dict[str, Any]) -> dict[str, Any]:
        """The input and the output as wholes (qtool.model_summary), from the plan's rows."""
        source = self.plan.source
        rows = plan["weights"]
        return {
            "input": describe_model(
                source.path,
                source.format,
                ((w["from"], _parameters(w["shape"]), w["bytes_before"]) for w in rows),
                revision=self.input_revision,
            ),
            "output": describe_model(
                self.plan.output,
                self.plan.layout.container,
                ((w["scheme"], _parameters(w["shape"]), w["bytes_after"]) for w in rows),
                revision=None,
            ),
        }


def _parameters(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


# -- qtool convert -------------------------------------------------------------------------------


def exact_by_construction(job: Job) -> bool | None:
    """True where a converted weight's written values are the input's float32 values bit for bit
    whatever they are: a copy (its own bytes), and anything written as float32 (every float
    widens exactly, and a quantized weight's decoding is float32, as llama.cpp's dequantization
    gives it). None where it depends on the values (a narrower dtype): measured when written."""
    if job.action == COPY:
        return True
    if job.action in (DEQUANTIZE, CAST) and job.out_dtype == "F32":
        return True
    return None


def _conversion_row(plan: Plan, job: Job, exact: bool | None) -> dict[str, Any]:
    tensor = job.outputs[0]
    stored = job.weight.data
    return {
        "name": tensor.name,
        "input_name": job.weight.name,
        "action": job.action,
        "from": job.weight.scheme.label if job.weight.scheme else stored.dtype.name,
        "stored_as": stored.encoding or stored.dtype.name,
        "dtype": tensor.dtype,
        "shape": list(tensor.shape),
        "bytes_before": job.bytes_in,
        "bytes_after": job.bytes_out,
        "file": plan.files[job.shard],
        "exact": exact,
    }


def _side_files(plan: Plan) -> list[str]:
    """The names of the files a conversion writes beside the weights: the layout's (config.json,
    a sharded output's index), the plan's own (a GGUF's tokenizer), the input folder's carried over."""
    from qtool.side_files import carried_over

    carried = [] if plan.single_file else [name for _, name in carried_over(plan.source)]
    return sorted({*plan.layout.side_files(plan), *(name for name, _ in plan.side_bytes), *carried})


def conversion_plan_document(plan: Plan, target: str) -> dict[str, Any]:
    """`qtool convert --dry-run`'s document: the plan's, each weight's row saying what it becomes
    (name, dtype) and whether it is exact by construction (`exact` true) or is measured when
    written (`exact` null)."""
    document = plan.to_json()
    rows = [_conversion_row(plan, job, exact_by_construction(job)) for job in plan.jobs]
    return {
        **document,
        "target": target,
        "weights": rows,
        "side_files": _side_files(plan),
    }


@dataclass(frozen=True)
class ConvertReport:
    """What `qtool convert` reports: the run's document (`RunReport`'s) with every weight written,
    each `exact` (its written values the input's float32 values bit for bit) or, where not, its
    error against them (`qtool.pipeline.Measurements.written`)."""

    run: RunReport
    target: str

    def exactness(self, job: Job) -> bool | None:
        by_construction = exact_by_construction(job)
        if by_construction:
            return True
        measured = self.run.measured
        stats = (measured.errors if job.action == QUANTIZE else measured.written).get(
            job.weight.name
        )  # a moved weight: its encoder measured it
        if stats is None:
            return None  # not measured
        return stats.noise == 0.0  # a NaN noise (a NaN value cast) is not exact either

    def to_json(self) -> dict[str, Any]:
        document = self.run.to_json()
        plan, measured = self.run.plan, self.run.measured
        rows = []
        for job in plan.jobs:
            exact = self.exactness(job)
            row = _conversion_row(plan, job, exact)
            if exact is False:
                stats = (measured.errors if job.action == QUANTIZE else measured.written)[job.weight.name]
                non_finite = measured.non_finite.get(job.weight.name)
                if non_finite:
                    row["why"] = (
                        f"its float32 values hold {non_finite}, which no error figure measures: not counted as exact"
                    )
                elif job.action == QUANTIZE and isinstance(job.encoding, Moved):  # its grid, other arithmetic
                    row["why"] = (
                        "the same codes and scales, but the source rounds each product to its scales' dtype "
                        "where the target forms it in float32"
                    )
                elif job.action == QUANTIZE:
                    row["why"] = f"its codes could not move: decoded and quantized again as {job.scheme.label}"
                else:
                    row["why"] = f"its float32 values are not all representable in {job.out_dtype}"
                row.update(stats.to_json())
            row["non_finite_decoded"] = measured.non_finite.get(job.weight.name)
            rows.append(row)
        summary = {
            **document["summary"],
            "exact_weights": sum(1 for row in rows if row["exact"]),
            "inexact_weights": [row["name"] for row in rows if row["exact"] is False],
        }
        return {
            **document,
            "target": self.target,
            "side_files": _side_files(plan),
            "summary": summary,
            "weights": rows,
        }
