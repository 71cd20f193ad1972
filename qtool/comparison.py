"""Compare two checkpoints weight by weight: is the quantized model still close to the original?

A is the reference, B the candidate. Weights pair up by logical name (after the built-in
GGUF -> Hugging Face map for LLaMA-family GGUF files, then the user's `--map` rules, see
`qtool.naming`). Each pair is decoded on the device, both sides to float, and measured chunk
by chunk with `ErrorStats`:

    SQNR (dB)      10 * log10(sum a^2 / sum (a - b)^2)     per weight, and over every pair
    relative RMSE  sqrt(sum (a - b)^2 / sum a^2)
    max abs error  max |a - b|
    cosine         sum a * b / sqrt(sum a^2 * sum b^2)

Integer and boolean tensors (position_ids, masks) have no float value to measure and would
swamp the signal: they are compared for equality only, counted apart (`summary.integer`), and a
difference is a finding. The model-wide figures cover the float weights, as `qtool quantize`'s
`all_weights` does.

Memory stays bounded as in quantize: one pair (two weights) at a time, never two models. A
plain weight is streamed in chunks with pread (no mmap pages linger); a quantized one is
decoded into one float tensor, and its members' pages are released after its pair. The
chunks are measured with `ErrorStats.update` (float64 terms and sums, numpy on the calling
thread for CPU tensors: the same definition as `qtool quantize` reports), in slices small
enough to stay in cache. Process state (torch's thread count) is never touched.

GGUF files written for LLaMA (`general.architecture = llama`) hold q_proj and k_proj with
their rows permuted per head, as llama.cpp's converter writes them; matched against a non-GGUF
side, those rows are permuted back before measuring, or the SQNR would be meaningless.

What fails a run (exit 1) is a *violation*: a finding on a pair (shapes differ, NaN or Inf
values, data that can't be compared), or a breach of a gate. Gates compare the values as
reported (9 significant digits), so a threshold copied from a report passes, and the next
float past it fails.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterator, Sequence

from qtool.error_measures import ErrorStats, count_non_finite
from qtool.comparison_smoothing import (
    ROLE_NORM,
    ROLE_RESCALED,
    ROLE_UNRECOVERED,
    Smoothing,
    SmoothingFound,
    find_smoothing,
    rescaled_chunks,
)
from qtool.errors import UsageError, ViolationError
from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.message_text import counted
from qtool.model_summary import describe_model  # issue 23: the report's header facts
from qtool.naming import Rename, gguf_to_hf, rename, rope_heads
from qtool.sqnr_histogram import HISTOGRAM_BIN_DB, sqnr_histogram
from qtool.weight import Weight
from qtool.weight_position import weight_position

__all__ = [
    "SCHEMA_VERSION",
    "CHUNK_ELEMENTS",
    "HISTOGRAM_BIN_DB",
    "Pair",
    "Comparison",
    "Gates",
    "plan_comparison",
    "run_comparison",
]

SCHEMA_VERSION = 1
CHUNK_ELEMENTS = 1 << 18  # elements per read chunk (pread); ErrorStats.update slices it further


def reported(value: float) -> float:
    """A measure as JSON and the gates see it: 9 significant digits."""
    return float(f"{value:.9g}") if math.isfinite(value) else value


@dataclass
class Pair:
    name: str  # A's name
    a: Weight
    b: Weight
    rope_heads: int | None = None  # the GGUF side's q/k rows were permuted over this many heads
    rope_side: str = "b"  # which side is the GGUF one: "a" or "b"
    stats: ErrorStats | None = None
    finding: str | None = None  # why this pair could not be measured, or what is wrong with it
    notes: list[str] = field(default_factory=list)
    # integer or boolean data (position_ids, masks): compared for equality, never in an error
    # figure, whose signal its values would inflate (MiniLM's 0..511 added 27.55 dB)
    integer: bool = False
    equal: bool | None = None
    key: str = ""  # the name both sides matched on (after the GGUF map and --map)
    # AWQ's smoothing (qtool.comparison_smoothing): measured against A times its scales, or
    # without an error figure (a smoothed norm; a Linear smoothed through a quantized one)
    smoothing: Smoothing | None = None

    @property
    def unmeasured(self) -> bool:
        """Checked (shapes, NaN/Inf) but with no error figure by design: the smoothing says why."""
        return self.smoothing is not None and not self.smoothing.measured and self.finding is None

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    @property
    def sqnr_db(self) -> float:
        return self.stats.sqnr_db if self.stats is not None else math.nan

    @property
    def exact(self) -> bool:
        if self.integer:
            return self.finding is None and bool(self.equal)
        return self.stats is not None and self.finding is None and self.stats.noise == 0

    def sort_key(self) -> tuple[int, float]:
        """Worst first: findings, then SQNR ascending, exact matches (equal integers too), then
        the pairs with no error figure by design (AWQ's smoothed norms and folds)."""
        if self.unmeasured:
            return (2, 0.0)
        if self.integer and self.exact:
            return (1, math.inf)
        if self.finding is not None or self.stats is None or math.isnan(self.sqnr_db):
            return (0, 0.0)
        return (1, self.sqnr_db)

    def to_json(self) -> dict[str, Any]:
        measures = (
            self.stats.to_json()
            if self.stats is not None and self.finding is None
            else dict.fromkeys(("sqnr_db", "rel_rmse", "max_abs_err", "cosine"))
        )
        return {
            "name": self.name,
            "name_b": self.b.name,
            "shape": list(self.a.shape),
            "shape_b": list(self.b.shape),
            "scheme_a": self.a.scheme.label if self.a.scheme else None,
            "scheme_b": self.b.scheme.label if self.b.scheme else None,
            "exact": self.exact,
            **measures,
            "finding": self.finding,
            "notes": [
                *self.notes,
                *([self.smoothing.note] if self.smoothing is not None and self.finding is None else []),
            ],
            # added for issue 23 (the HTML report): where the weight sits, and its size on each side
            **weight_position(self.name).to_json(),
            "parameters": self.a.parameters,
            "bytes_a": self.a.nbytes,
            "bytes_b": self.b.nbytes,
            "integer": self.integer,  # added (issue 18): compared for equality, outside the error figures
            # added (issue 42 #22): AWQ's smoothing, {"role": "norm" | "rescaled" | "unrecovered", "by": A's name}
            "smoothing": self.smoothing.to_json() if self.smoothing is not None else None,
        }


@dataclass(frozen=True)
class Gates:
    min_sqnr: float | None = None  # dB, per weight
    max_rel_rmse: float | None = None  # per weight
    max_missing: int | None = None  # weights of A or B without a counterpart

    @property
    def any_set(self) -> bool:
        return any(value is not None for value in (self.min_sqnr, self.max_rel_rmse, self.max_missing))

    def to_json(self) -> dict[str, float | int | None]:
        return {"min_sqnr": self.min_sqnr, "max_rel_rmse": self.max_rel_rmse, "max_missing": self.max_missing}


@dataclass
class Comparison:
    a: Checkpoint
    b: Checkpoint
    pairs: list[Pair]
    only_a: list[str]
    only_b: list[str]
    weights_a: int
    weights_b: int
    device: str = "cpu"
    seconds: float = 0.0
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # "a", "b": qtool.model_summary.describe_model
    smoothing: SmoothingFound = field(default_factory=SmoothingFound)  # AWQ's smoothing, found by run_comparison

    @property
    def total_bytes(self) -> int:
        return sum(pair.nbytes for pair in self.pairs)

    @property
    def measured(self) -> list[Pair]:
        """The float pairs with error figures: integer and boolean data are compared apart."""
        return [p for p in self.pairs if p.stats is not None and p.finding is None and not p.integer]

    @property
    def integers(self) -> list[Pair]:
        return [p for p in self.pairs if p.integer]

    def model_error(self) -> ErrorStats:
        total = ErrorStats()
        for pair in self.measured:
            total = total.merge(pair.stats)  # type: ignore[arg-type]
        return total

    def worst(self) -> Pair | None:
        return min(self.pairs, key=Pair.sort_key, default=None)

    def histogram(self) -> dict[str, Any]:
        """Per-weight SQNR in `HISTOGRAM_BIN_DB` bins, from the lowest filled bin to the highest;
        exact matches (and pairs whose A is all zeros while B is not) are counted apart."""
        return sqnr_histogram(p.sqnr_db for p in self.measured)

    def smoothing_line(self) -> str | None:
        """One line for the run where B is AWQ-smoothed: what was measured how, and what has no
        weight SQNR. None otherwise."""
        return self.smoothing.line()

    def nothing_compared(self) -> str | None:
        """Why nothing was compared, when no weight of A pairs with one of B (a GGUF dequantized
        back keeps GGUF names; the original has Hugging Face names): such a comparison measured
        nothing, so it can't pass. None when something paired."""
        if self.pairs:
            return None
        return f"nothing was compared: no weight of A pairs with one of B by name ({self.weights_a} in A, {self.weights_b} in B)"

    def violations(self, gates: Gates = Gates()) -> list[str]:
        """One line per violation: nothing compared, findings, then gate breaches, worst first."""
        nothing = self.nothing_compared()
        lines = [nothing] if nothing else []
        lines += [f"{p.name}: {p.finding}" for p in sorted(self.pairs, key=Pair.sort_key) if p.finding is not None]
        for pair in sorted(self.measured, key=Pair.sort_key):
            stats = pair.stats
            if stats is None:  # `measured` holds the pairs that have stats
                continue
            if gates.min_sqnr is not None and not reported(stats.sqnr_db) >= gates.min_sqnr:
                lines.append(f"{pair.name}: SQNR {_show(stats.sqnr_db)} dB is below --min-sqnr {gates.min_sqnr:g}")
            if gates.max_rel_rmse is not None and not reported(stats.rel_rmse) <= gates.max_rel_rmse:
                lines.append(
                    f"{pair.name}: relative RMSE {_show(stats.rel_rmse)} is above --max-rel-rmse {gates.max_rel_rmse:g}"
                )
        missing = len(self.only_a) + len(self.only_b)
        if gates.max_missing is not None and missing > gates.max_missing:
            lines.append(
                f"{missing} weights have no counterpart ({len(self.only_a)} only in A, {len(self.only_b)} only in B), "
                f"more than --max-missing {gates.max_missing}"
            )
        return lines

    def raise_for_violations(self, gates: Gates = Gates()) -> None:
        lines = self.violations(gates)
        if lines:
            raise ViolationError(f"{counted(len(lines), 'violation')}: {lines[0]}", reasons=lines)

    def to_json(self, gates: Gates = Gates()) -> dict[str, Any]:
        worst = self.worst()
        violations = self.violations(gates)
        return {
            "schema_version": SCHEMA_VERSION,
            "a": self.a.path,
            "b": self.b.path,
            "device": self.device,
            "seconds": round(self.seconds, 3),
            "summary": {
                "weights_a": self.weights_a,
                "weights_b": self.weights_b,
                "matched": len(self.pairs),
                "measured": len(self.measured),
                "exact": sum(1 for p in self.pairs if p.exact),
                "findings": sum(1 for p in self.pairs if p.finding is not None),
                "only_in_a": len(self.only_a),
                "only_in_b": len(self.only_b),
                # figures that were not measured are null, never 0 (nor "no error")
                **(
                    self.model_error().to_json()
                    if self.measured
                    else dict.fromkeys(("sqnr_db", "rel_rmse", "max_abs_err", "cosine"))
                ),
                "worst": None
                if worst is None
                else {
                    "name": worst.name,
                    "sqnr_db": worst.to_json()["sqnr_db"],
                    "exact": worst.exact,
                    "finding": worst.finding,
                },
                "histogram": self.histogram(),
                # added (issue 18): integer and boolean tensors, compared for equality only
                "integer": {"compared": len(self.integers), "equal": sum(1 for p in self.integers if p.exact)},
                # added (issue 42 #22): null, or {"norms": int, "rescaled": int, "unrecovered": int, "line": str}
                "smoothing": self.smoothing.to_json(),
            },
            "weights": [pair.to_json() for pair in sorted(self.pairs, key=Pair.sort_key)],
            "only_in_a": list(self.only_a),
            "only_in_b": list(self.only_b),
            "gates": gates.to_json(),
            "violations": violations,
            "ok": not violations,
            "models": self.models,  # added for issue 23
        }


def _show(value: float) -> str:
    return f"{reported(value):.9g}" if math.isfinite(value) else str(value)


# -- matching ----------------------------------------------------------------------------------


def _keyed(
    checkpoint: Checkpoint, weights: list[Weight], rules: Sequence[Rename], from_gguf: bool
) -> dict[str, Weight]:
    keyed: dict[str, Weight] = {}
    for weight in weights:
        key = rename(gguf_to_hf(weight.name) if from_gguf else weight.name, rules)
        if key in keyed:
            raise UsageError(
                f"{checkpoint.path}: {keyed[key].name!r} and {weight.name!r} both become {key!r}",
                hint="make the map rules more specific",
                option="maps",
            )
        keyed[key] = weight
    return keyed


def plan_comparison(
    a: Checkpoint,
    weights_a: list[Weight],
    b: Checkpoint,
    weights_b: list[Weight],
    rules: Sequence[Rename] = (),
    *,
    gguf_names: bool = True,
) -> Comparison:
    """Pair the weights by name and check shapes; reads no data."""
    gguf_a = gguf_names and a.format == "gguf" and b.format != "gguf"
    gguf_b = gguf_names and b.format == "gguf" and a.format != "gguf"
    keyed_a = _keyed(a, weights_a, rules, gguf_a)
    keyed_b = _keyed(b, weights_b, rules, gguf_b)
    pairs = []
    for key, weight_a in keyed_a.items():
        weight_b = keyed_b.get(key)
        if weight_b is None:
            continue
        pair = Pair(weight_a.name, weight_a, weight_b, key=key)
        if gguf_a or gguf_b:
            gguf_side, gguf_weight = ("a", weight_a) if gguf_a else ("b", weight_b)
            pair.rope_heads = rope_heads(gguf_to_hf(gguf_weight.name), (a if gguf_a else b).metadata)
            pair.rope_side = gguf_side
        if weight_a.shape != weight_b.shape:
            pair.finding = f"shape mismatch: A {list(weight_a.shape)}, B {list(weight_b.shape)}"
        elif pair.rope_heads and (not weight_a.shape or weight_a.shape[0] % (2 * pair.rope_heads)):
            pair.notes.append(
                f"{weight_a.shape[0]} rows do not split into {pair.rope_heads} rotary heads; compared as stored"
            )
            pair.rope_heads = None
        pairs.append(pair)
    only_a = [w.name for key, w in keyed_a.items() if key not in keyed_b]
    only_b = [w.name for key, w in keyed_b.items() if key not in keyed_a]
    models = {
        side: _describe(checkpoint, weights) for side, checkpoint, weights in (("a", a, weights_a), ("b", b, weights_b))
    }
    return Comparison(a, b, pairs, only_a, only_b, len(weights_a), len(weights_b), models=models)


def _describe(checkpoint: Checkpoint, weights: list[Weight]) -> dict[str, Any]:
    return describe_model(
        checkpoint.path,
        checkpoint.format,
        ((w.scheme.label if w.scheme else None, w.parameters, w.nbytes) for w in weights),
    )


# -- measuring ---------------------------------------------------------------------------------


class _NotComparable(ValueError):
    pass


def _source(checkpoint: Checkpoint, weight: Weight, device: str, rope_heads: int | None):
    """What to measure a weight from: its decoded float tensor on `device` (quantized, or rows
    to un-permute, or complex), or its `StoredTensor`, streamed by `_chunks`, so a plain weight
    never sits in memory whole, nor in mmap pages."""
    import torch

    stored = weight.data
    if weight.quantized:
        from qtool.conventions import decoder_for

        values = decoder_for(weight).decode(checkpoint, weight, device)
    elif stored.dtype.torch_name is None:
        raise _NotComparable(
            f"{weight.name} is plain {stored.dtype.name} data, which has no float value without a scale"
        )
    elif rope_heads or stored.dtype.torch_dtype().is_complex:
        values = checkpoint.load(stored).to(device)
        if values.is_complex():
            values = torch.view_as_real(values)
    else:
        return stored
    return _unpermute(values, rope_heads) if rope_heads else values


def _numel(source) -> int:
    return source.numel if isinstance(source, StoredTensor) else source.numel()


def _chunks(checkpoint: Checkpoint, source, device: str) -> Iterator[Any]:
    """Flat chunks of CHUNK_ELEMENTS values; a stored tensor's are read one at a time with
    `Checkpoint.read_bytes` (pread where the container has a byte range)."""
    import torch

    if not isinstance(source, StoredTensor):
        flat = source.reshape(-1)
        for start in range(0, flat.numel(), CHUNK_ELEMENTS):
            yield flat[start : start + CHUNK_ELEMENTS]
        return
    dtype = source.dtype.torch_dtype()
    step = CHUNK_ELEMENTS * dtype.itemsize
    for offset in range(0, source.nbytes, step):
        data = checkpoint.read_bytes(source, offset, min(step, source.nbytes - offset))
        chunk = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
        yield chunk.to(device) if device != "cpu" else chunk


def _unpermute(tensor, heads: int):
    """llama.cpp's rotary row order back to Hugging Face's: the inverse of
    `reshape(heads, 2, r, ...).swapaxes(1, 2)` in convert_hf_to_gguf.py's `LlamaModel.permute`."""
    shape = tuple(tensor.shape)
    return tensor.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _measure(chunks_x: Iterator[Any], chunks_y: Iterator[Any]) -> tuple[ErrorStats, int, int]:
    """ErrorStats over paired chunks, and the NaN/Inf counts of each side where the sums stop
    being finite. A chunk stored identically on both sides (a copied embedding, a norm) costs
    one dot product: its error is zero, so x·y = y·y = x·x."""
    import torch

    stats = ErrorStats()
    bad_x = bad_y = 0
    for chunk_x, chunk_y in zip(chunks_x, chunks_y):
        if chunk_x.dtype == chunk_y.dtype and torch.equal(chunk_x, chunk_y):
            part = ErrorStats().update(chunk_x, chunk_x)  # no error: the same float64 sums, e = 0
        else:
            part = ErrorStats().update(chunk_x, chunk_y)
        if not all(math.isfinite(v) for v in (part.signal, part.noise, part.dot)):
            bad_x, bad_y = bad_x + sum(count_non_finite(chunk_x)), bad_y + sum(count_non_finite(chunk_y))
        stats = stats.merge(part)
    return stats, bad_x, bad_y


def _is_integer(weight: Weight) -> bool:
    """Plain integer or boolean data: a count, an index, a mask; no float value to measure."""
    return not weight.quantized and (weight.data.dtype.is_integer or weight.data.dtype.kind == "bool")


def _compare_integers(comparison: Comparison, pair: Pair, device: str) -> None:
    """Equality, value by value (I32 against I64 compares the numbers), streamed in chunks."""
    import torch

    pair.integer = True
    if not (_is_integer(pair.a) and _is_integer(pair.b)):
        float_side = "A" if not _is_integer(pair.a) else "B"
        pair.finding = f"not comparable: {float_side} is float, the other integer ({pair.a.data.dtype.name} / {pair.b.data.dtype.name})"
        return
    x, y = pair.a.data, pair.b.data
    if x.numel != y.numel:
        pair.finding = f"not comparable: A has {x.numel} values, B {y.numel}"
        return
    differing = 0
    for chunk_x, chunk_y in zip(_chunks(comparison.a, x, device), _chunks(comparison.b, y, device)):
        differing += int((chunk_x.to(torch.int64) != chunk_y.to(torch.int64)).sum())
    pair.equal = differing == 0
    if differing:
        pair.finding = f"integer values differ: {differing} of {x.numel}"


def _measure_pair(comparison: Comparison, pair: Pair, device: str) -> None:
    x = y = None
    smoothing = pair.smoothing
    try:
        if _is_integer(pair.a) or _is_integer(pair.b):
            _compare_integers(comparison, pair, device)
            return
        if smoothing is not None and smoothing.role == ROLE_NORM:
            return  # its values are the scales (read, and found finite, by find_smoothing)
        x = _source(comparison.a, pair.a, device, pair.rope_heads if pair.rope_side == "a" else None)
        y = _source(comparison.b, pair.b, device, pair.rope_heads if pair.rope_side == "b" else None)
        if pair.rope_heads:
            pair.notes.append(
                f"{pair.rope_side.upper()}'s rows un-permuted from llama.cpp's rotary order ({pair.rope_heads} heads)"
            )
        if _numel(x) != _numel(y):
            pair.finding = f"not comparable: A has {_numel(x)} values, B {_numel(y)}"
            return
        chunks_x = _chunks(comparison.a, x, device)
        if smoothing is not None and smoothing.role == ROLE_RESCALED:  # A in the basis of B's smoothed codes
            chunks_x = rescaled_chunks(chunks_x, smoothing.scales)
        stats, bad_x, bad_y = _measure(chunks_x, _chunks(comparison.b, y, device))
        if not all(math.isfinite(v) for v in (stats.signal, stats.noise, stats.dot)):
            where = ", ".join(
                f"{side} has {count} NaN/Inf values" for side, count in (("A", bad_x), ("B", bad_y)) if count
            )
            pair.finding = f"non-finite values: {where or 'the error overflows float64'}"
        if smoothing is None or smoothing.role != ROLE_UNRECOVERED or pair.finding is not None:
            pair.stats = stats  # an unrecovered fold is checked for NaN/Inf, with no error figure
    except _NotComparable as exc:
        pair.finding = f"not comparable: {exc}"
    finally:
        del x, y
        for weight, checkpoint in ((pair.a, comparison.a), (pair.b, comparison.b)):
            for member in weight.members.values():
                checkpoint.release(member)


def run_comparison(
    comparison: Comparison, *, device: str = "cpu", on_progress: Callable[[int], None] | None = None
) -> Comparison:
    """Measure every pair whose shapes agree, one pair at a time, in A's order."""
    started = time.perf_counter()
    comparison.device = device
    comparison.smoothing = find_smoothing(comparison.pairs, comparison.a, comparison.b, device)
    for pair in comparison.pairs:
        if pair.finding is None:
            _measure_pair(comparison, pair, device)
        if on_progress:
            on_progress(pair.nbytes)
    comparison.seconds = time.perf_counter() - started
    return comparison
