"""The Python API; the CLI is a thin layer over these functions.

>>> import qtool
>>> report = qtool.inspect("sample_models/tiny-llama")
>>> report.summary()["parameters"]
722176
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Sequence

from qtool.errors import UsageError
from qtool.evaluation.report import OutputGates
from qtool.formats import Checkpoint
from qtool.formats import open_checkpoint as _open_checkpoint
from qtool.formats.gguf import use_prefixed_walk
from qtool.inspection import Inspection, inspect_checkpoint
from qtool.planning.paths import refuse_remote_data

if TYPE_CHECKING:
    from qtool.audit import Audit, CheckRules
    from qtool.spread.distribute import WorkerPool
    from qtool.comparison import Comparison
    from qtool.formats.imatrix import Imatrix
    from qtool.plan import Plan
    from qtool.policy import Policy
    from qtool.reports import ConvertReport, RunReport

__all__ = [
    "import_transformers_lean",
    "open_checkpoint",
    "refuse_remote_data",
    "inspect",
    "collect_stats",
    "read_imatrix",
    "imatrix_of",
    "imatrix",
    "evaluate",
    "OutputGates",
    "prepare_quantize",
    "prepare_dequantize",
    "prepare_convert",
    "convert_plan_document",
    "run_convert",
    "convert",
    "worker_pool",
    "run",
    "quantize",
    "dequantize",
    "prepare_compare",
    "run_compare",
    "compare",
    "check",
    "schemes",
    "load_policy",
    "refuse_report_paths",
    "write_report",
    "overlay_document",
]


def _prefixed_walk(buf, pos: int, count: int) -> int | None:
    """qtool.native's walk over a GGUF header's string arrays (a 49k-token vocabulary: ~15 ms
    in Python), imported on the first GGUF header read; None without the extension."""
    from qtool import native

    return native.skip_prefixed(buf, pos, count)


use_prefixed_walk(_prefixed_walk)  # formats may not import qtool.native: it is handed in here


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint's headers and side files. No tensor data is read."""
    return _open_checkpoint(path)


def inspect(path: str | os.PathLike[str], filter: str | None = None) -> Inspection:
    """Every weight of a checkpoint with its shape, dtype and scheme, from the headers alone;
    with `filter` (a glob, or `re:` and a regex, as in qtool.patterns) only the weights whose
    name matches, and the summary covers only those."""
    return inspect_checkpoint(_open_checkpoint(path), filter=filter)


def read_imatrix(path: str | os.PathLike[str]) -> Imatrix:
    """A llama.cpp importance-matrix file (GGUF or legacy .dat), every entry checked: what
    `quantize(..., imatrix=path)` reads, and `qtool inspect` shows."""
    from qtool.formats.imatrix import read_imatrix as _read

    refuse_remote_data(path)
    return _read(path)


def imatrix_of(path: str | os.PathLike[str], inspection: Inspection | None = None) -> Imatrix | None:
    """The importance matrix `path` holds, or None when it is a model: a legacy `.dat` file, or
    a GGUF whose header (`inspection`'s, when given: nothing is read twice) says it is one."""
    from qtool.formats.imatrix import is_imatrix_gguf

    if inspection is None:
        if os.fspath(path).endswith(".dat") and os.path.isfile(path):
            return read_imatrix(path)
        return None
    checkpoint = inspection.checkpoint
    if checkpoint.format == "gguf" and is_imatrix_gguf(checkpoint.metadata, checkpoint.tensors):
        return read_imatrix(checkpoint.files[0])
    return None


def collect_stats(inspection: Inspection, on_bytes: Callable[[int], None] | None = None) -> Inspection:
    """A new Inspection with the value stats of every plain weight it reports, streamed from
    the data; the checkpoint is closed afterwards. Reads with numpy; never imports torch."""
    from qtool.value_stats import collect_stats as _collect_stats

    inspection.checkpoint.require_local()

    return _collect_stats(inspection, on_bytes)


# -- quantize and dequantize -------------------------------------------------------------------


def prepare_quantize(
    path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    scheme: str = "W4A16",
    *,
    include: Sequence[str] = (),
    ignore: Sequence[str] = (),
    tensor_schemes: Sequence[str] = (),
    layout: str = "auto",
    dtype: str | None = None,
    max_shard_size: str | None = None,
    allow_requantize: bool = False,
    report: str | os.PathLike[str] | None = None,
    allow_incomplete_gguf: bool = False,
    pure: bool = False,
    html: str | os.PathLike[str] | None = None,
    observer: str | None = None,
    calibrate: str | os.PathLike[str] | None = None,
    algorithm: str | None = None,
    samples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    actorder: str | None = None,
    true_sequential: bool = False,
    imatrix: str | os.PathLike[str] | None = None,
) -> Plan:
    """Plan a quantization: which weights, which scheme and layout, every output tensor.
    Writes nothing; refuses an impossible job (and every unsafe output path) here.
    A GGUF from a Hugging Face checkpoint must be a model llama.cpp runs (llama, mistral, qwen2,
    with its tokenizer) unless `allow_incomplete_gguf`. `pure` gives every tensor a llama.cpp
    file type quantizes its default type, with the row fallbacks (`llama-quantize --pure`).
    `observer` ("minmax" or "mse") chooses the scales of `scheme` and of every tensor scheme
    that names none (a scheme string may also end in `:mse`).
    `calibrate` (a .txt, a .jsonl with a "text" field, or a folder of them) makes it a
    calibrated quantization: `algorithm` gptq (the default), awq or rtn, on `samples` windows of
    `seq_len` tokens drawn with `seed`, GPTQ's columns in activation order (`actorder`
    "static", llm-compressor's default, or its alias "weight"; "none" for the stored order), and with `true_sequential` each layer's Linears in the
    order the layer calls them, each on the outputs of those quantized before it, in one run of
    the layer (qtool.calibration.true_sequential); checked here, run by `run` before the
    executor; with a GGUF output it computes llama.cpp's importance matrix instead.
    `imatrix` (a llama.cpp importance matrix, GGUF or legacy .dat; GGUF output only) weighs the
    GGUF quantizers as `llama-quantize --imatrix` does, and is recorded in the output."""
    from qtool.planning.quantize import plan_quantize
    from qtool.planning.request import QuantizeRequest

    request = QuantizeRequest.from_options(
        path, output, scheme, include=include, ignore=ignore, tensor_schemes=tensor_schemes, layout=layout, dtype=dtype,
        max_shard_size=max_shard_size, allow_requantize=allow_requantize, report=report, allow_incomplete_gguf=allow_incomplete_gguf,
        pure=pure, html=html, observer=observer, calibrate=calibrate, algorithm=algorithm, samples=samples, seq_len=seq_len,
        seed=seed, actorder=actorder, true_sequential=true_sequential, imatrix=imatrix,
    )  # fmt: skip
    return plan_quantize(request)


def prepare_dequantize(
    path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    max_shard_size: str | None = None,
) -> Plan:
    """Plan decoding every quantized weight to float, keyed by its logical name (a llama or qwen2
    GGUF's tensors by their Hugging Face names, q/k rows in Hugging Face's order). Writes nothing."""
    from qtool.planning.quantize import plan_dequantize

    return plan_dequantize(path, os.fspath(output), dtype, max_shard_size)


def worker_pool(plan: Plan, workers: int) -> WorkerPool:
    """How many local worker processes `run(plan, workers=workers)` starts: at most the shard
    jobs it cuts the plan into, and what the available memory holds at the largest job's
    working set estimate (`WorkerPool.capped` says whether that is fewer than asked)."""
    from qtool.spread.distribute import worker_pool as pool

    if workers < 1:
        raise UsageError(f"workers {workers} must be at least 1", option="workers")
    return pool(plan, workers)


def run(
    plan: Plan,
    *,
    device: str = "cpu",
    threads: int | None = None,
    measure: bool = True,
    on_progress: Callable[[int], None] | None = None,
    overwrite: bool = False,
    workers: int = 1,
    executor: str = "local",
    ray_address: str | None = None,
    max_retries: int | None = None,
    worker_setup: Callable[[], None] | None = None,
    on_layer: Callable[[Any, int], None] | None = None,
    exactness: bool = False,
) -> RunReport:
    """Stream a plan to its output, atomically, and write its report (if the plan names one)
    before the output is committed: on `device` (cpu, cuda, cuda:N, auto), with `threads` CPU
    threads for the kernels, each quantized weight's error reported unless `measure` is off
    (a finite weight whose scale overflows is refused either way),
    `on_progress` called with input bytes done. Imports torch unless qtool.native runs every
    job. Changes no process state.

    `workers` > 1 runs the plan as shard jobs in that many spawned processes, `threads` divided
    among them; `executor="ray"` on a Ray cluster (`ray_address`, else RAY_ADDRESS), each job
    a task of `threads` CPUs (default 1). A job whose worker is lost is retried up to
    `max_retries` times; `worker_setup` runs once in each worker process. The output is the
    same, byte for byte, and so is the report, but for timings and its `execution` part.

    A calibrated plan calibrates first (`on_layer(layer result, layers)` after each decoder
    layer), in this process, then streams.

    `exactness` (with `measure`) measures each float weight written against its float32
    values (`RunReport.measured.written`), as `run_convert` reports them; in one process only."""
    from qtool.formats.revision import revision_of
    from qtool.formats.writer import Output
    from qtool.pipeline import ExecOptions, execute, resolve_device
    from qtool.report_output import stage_report as stage
    from qtool.reports import RunReport

    if threads is not None and threads < 1:
        raise UsageError(f"threads {threads} must be at least 1", option="threads")
    spread = executor != "local" or workers != 1
    if spread and exactness:
        raise UsageError("a conversion's exactness is measured in one process", option="workers")
    if spread and plan.calibration is not None:
        raise UsageError(
            "a calibrated quantization runs layer by layer in one process",
            hint="a calibrated run takes neither workers nor another executor",
            option="workers",
        )
    runner = None
    if spread:
        from qtool.spread.distribute import threads_per_worker, worker_pool
        from qtool.spread.executors import DEFAULT_RETRIES, make_executor

        if device != "cpu" and (device != "auto" or resolve_device(device) != "cpu"):
            raise UsageError(
                f"device {device}: a run spread over workers runs on the CPU",
                hint="leave the workers and the executor out, or run on the cpu device",
                option="device",
            )
        requested = workers
        if executor == "local" and workers > 1:  # no more processes than jobs, or than memory holds
            workers = worker_pool(plan, workers).workers
        runner = make_executor(
            executor,
            workers=workers,
            address=ray_address,
            retries=DEFAULT_RETRIES if max_retries is None else max_retries,
            setup=worker_setup,
        )
        if executor == "local":
            threads = threads_per_worker(threads, workers)
        else:
            threads = threads or 1
    options = ExecOptions(
        device=resolve_device(device), threads=threads, measure=measure, on_progress=on_progress, exactness=exactness
    )
    staged: list = []
    revision = revision_of(plan.source.path)  # read now: the report's lookup never runs after the commit (issue 42)

    if plan.output is None:
        raise UsageError(
            "the plan names no output", hint="plan with qtool.api.prepare_quantize or prepare_dequantize", option="plan"
        )

    execution: dict[str, Any] | None = None

    def stage_report_spread(measured, shards) -> None:
        nonlocal execution
        execution = {
            "executor": runner.name,
            "workers": runner.workers,
            "threads_per_worker": options.threads,
            "shards": [s.to_json() for s in shards],
        }
        if runner.name == "local":
            execution["workers_requested"] = requested  # added for issue 42: the pool may be smaller
        stage_report(measured)

    def stage_report(measured) -> None:  # written in full before the output is committed
        if plan.report is None and plan.html is None:
            return
        document = RunReport(
            written,
            measured,
            options.device,
            execution,
            revision,
            calibration=calibrated.document if calibrated else None,
        ).to_json()
        if plan.report is not None:
            staged.append(
                stage(plan.report, "quantize", [document], overwrite=overwrite)
            )  # JSON, or HTML by its suffix
        if plan.html is not None:
            staged.append(stage(plan.html, "quantize", [document], html=True, overwrite=overwrite))

    output = None
    try:
        from qtool.planning import calibration

        calibrated = calibration.run(plan, options.device, threads, on_layer)
        written = plan if calibrated is None else calibrated.over(plan)  # the plan itself is not changed
        output = Output(plan.output, single_file=plan.single_file, overwrite=overwrite)
        if runner is None:
            measured = execute(written, output, options, before_commit=stage_report)
        else:
            from qtool.spread.distribute import execute_sharded

            measured, _ = execute_sharded(written, output, options, runner, before_commit=stage_report_spread)
    except BaseException:  # a Ctrl-C between the two lines above too: nothing is left
        if output is not None:
            output.abort()
        for report in staged:
            report.abort()
        raise
    finally:
        plan.source.close()
    for report in staged:
        report.commit()
    return RunReport(
        written, measured, options.device, execution, revision, calibration=calibrated.document if calibrated else None
    )


def quantize(
    path,
    output,
    scheme: str = "W4A16",
    *,
    device: str = "cpu",
    overwrite: bool = False,
    threads: int | None = None,
    **options,
) -> RunReport:
    """Quantize a checkpoint into `output` (a folder, a .safetensors or a .gguf file)."""
    return run(prepare_quantize(path, output, scheme, **options), device=device, threads=threads, overwrite=overwrite)


def dequantize(
    path, output, *, dtype: str | None = None, device: str = "cpu", overwrite: bool = False, threads: int | None = None
) -> RunReport:
    """Decode every quantized weight of a checkpoint to float, into `output`."""
    return run(
        prepare_dequantize(path, output, dtype=dtype),
        device=device,
        threads=threads,
        measure=False,
        overwrite=overwrite,
    )


# -- convert ---------------------------------------------------------------------------------------


def prepare_convert(
    path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    to: str = "hf",
    dtype: str = "f32",
    max_shard_size: str | None = None,
    requantize: str | None = None,
) -> Plan:
    """Plan converting a checkpoint to another toolchain's format (`to`): "hf", a Hugging Face
    model folder, from a llama or qwen2 GGUF (its weights decoded to `dtype` under their
    Hugging Face names, config.json from its metadata, its tokenizer as transformers writes
    it; any other checkpoint through `prepare_dequantize`'s plan); "compressed-tensors" and
    "gguf", each quantized weight's own codes moved as they are (`qtool.layouts.moves`), with
    `requantize` (compressed-tensors: a scheme, or "auto") quantizing again the weights whose
    codes cannot move. Writes nothing; refuses a target not built, a GGUF not mapped back, a
    weight whose codes cannot move, and every unsafe output path here."""
    from qtool.planning.convert import plan_convert

    return plan_convert(path, os.fspath(output), to, dtype, max_shard_size, requantize)


def convert_plan_document(plan: Plan, to: str = "hf") -> dict[str, Any]:
    """The `convert --dry-run` document: what each weight becomes, and whether it is exact by
    construction or measured when written."""
    from qtool.reports import conversion_plan_document

    return conversion_plan_document(plan, to)


def run_convert(
    plan: Plan,
    *,
    to: str = "hf",
    threads: int | None = None,
    overwrite: bool = False,
    on_progress: Callable[[int], None] | None = None,
) -> ConvertReport:
    """Write a prepared conversion, atomically, on the CPU, each weight's exactness measured:
    `.to_json()` is the `convert --json` document."""
    from qtool.reports import ConvertReport

    written = run(plan, threads=threads, measure=True, on_progress=on_progress, overwrite=overwrite, exactness=True)
    return ConvertReport(written, to)


def convert(
    path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    to: str = "hf",
    dtype: str = "f32",
    max_shard_size: str | None = None,
    requantize: str | None = None,
    overwrite: bool = False,
    threads: int | None = None,
) -> ConvertReport:
    """Convert a checkpoint into `output` (see `prepare_convert`) and say, per weight, whether
    it is exact: its written values the input's float32 values bit for bit."""
    plan = prepare_convert(path, output, to=to, dtype=dtype, max_shard_size=max_shard_size, requantize=requantize)
    return run_convert(plan, to=to, threads=threads, overwrite=overwrite)


# -- the importance matrix ---------------------------------------------------------------------


def imatrix(
    path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    calibrate: str | os.PathLike[str],
    *,
    chunks: int | None = None,
    chunk_size: int = 512,
    device: str = "cpu",
    threads: int | None = None,
    overwrite: bool = False,
    allow_incomplete_gguf: bool = False,
    on_layer: Callable[[Any, int], None] | None = None,
    on_start: Callable[[int, int, int], None] | None = None,
) -> dict[str, Any]:
    """llama.cpp's importance matrix of a Hugging Face model on a calibration text, written to
    `output` (.gguf) in llama-imatrix's GGUF format, with GGUF tensor names as qtool's GGUF
    conversion names them, so `llama-quantize --imatrix` (and `quantize(..., imatrix=)`) take
    it: `chunks` chunks of `chunk_size` tokens from the start of the text (all, by default),
    as llama-imatrix -c chunk_size --chunks N cuts them. `on_start(chunks, chunk_size, layers)`
    once the text is cut, before the first layer runs; `on_layer(layer, layers)` after each.
    Returns the `--json` document."""
    from qtool.planning.imatrix_command import compute_imatrix

    return compute_imatrix(
        path, os.fspath(output), os.fspath(calibrate), chunks=chunks, chunk_size=chunk_size, device=device, threads=threads,
        overwrite=overwrite, allow_incomplete_gguf=allow_incomplete_gguf, on_layer=on_layer, on_start=on_start,
    )  # fmt: skip


# -- outputs -----------------------------------------------------------------------------------


def evaluate(
    model: str | os.PathLike[str],
    text: str | os.PathLike[str],
    *,
    base: str | os.PathLike[str] | None = None,
    ctx: int = 512,
    windows: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int | None = None,
    gates: OutputGates | None = None,
    on_start: Callable[[int, int, int], None] | None = None,
    on_layer: Callable[[int, int, float], None] | None = None,
) -> dict[str, Any]:
    """The model's perplexity on `text`, scored as llama-perplexity scores it (consecutive
    windows of `ctx` tokens, the first `windows` of them, each starting with the BOS where the
    tokenizer adds one, the loss over each window's second half); with `base`, both run in
    lockstep one decoder layer at a time: the KL divergence of the model's next-token
    distributions from the base's, their top-1 agreement, both perplexities and each layer's
    hidden-state error. Any checkpoint qtool reads whose architecture transformers builds
    (a GGUF of the LLaMA family through its Hugging Face names). `gates` (which need a base)
    set the document's violations. `on_start(windows, ctx, steps)` before the first layer
    runs, `on_layer(step, steps, seconds)` after each. Returns the `--json` document."""
    from qtool.evaluation.evaluate import evaluate as _evaluate

    return _evaluate(
        model, text, base=base, ctx=ctx, windows=windows, device=device, dtype=dtype, threads=threads, gates=gates,
        on_start=on_start, on_layer=on_layer,
    )  # fmt: skip


# -- compare and check -------------------------------------------------------------------------


def prepare_compare(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    maps: Sequence[str] = (),
    gguf_names: bool = True,
) -> Comparison:
    """Pair A's weights with B's by logical name and check their shapes, from the headers.

    `maps` are rename rules, `OLD=NEW` (`re:` regex anchored at the start, else a literal
    prefix), applied in order to both sides' names. With `gguf_names`, a GGUF side's LLaMA
    names are read as Hugging Face names first (`blk.0.attn_q.weight` ->
    `model.layers.0.self_attn.q_proj.weight`)."""
    from qtool.comparison import plan_comparison
    from qtool.naming import parse_rename

    rules = [parse_rename(text) for text in maps]
    refuse_remote_data(a)
    refuse_remote_data(b)
    checkpoint_a = _open_checkpoint(a)
    checkpoint_a.require_local()
    checkpoint_b = _open_checkpoint(b)
    checkpoint_b.require_local()
    return plan_comparison(
        checkpoint_a,
        inspect_checkpoint(checkpoint_a).weights,
        checkpoint_b,
        inspect_checkpoint(checkpoint_b).weights,
        rules,
        gguf_names=gguf_names,
    )


def compare(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    maps: Sequence[str] = (),
    device: str = "cpu",
    gguf_names: bool = True,
    on_progress: Callable[[int], None] | None = None,
) -> Comparison:
    """Measure B against A weight by weight (SQNR, relative RMSE, max abs error, cosine),
    both sides dequantized on `device`, one pair at a time. Imports torch.

    `.violations(Gates(min_sqnr=...))` lists what breaks a gate; `.to_json()` is the
    `qtool compare --json` document."""
    return run_compare(prepare_compare(a, b, maps=maps, gguf_names=gguf_names), device=device, on_progress=on_progress)


def run_compare(
    comparison: Comparison, *, device: str = "cpu", on_progress: Callable[[int], None] | None = None
) -> Comparison:
    """Measure a prepared comparison (`on_progress` gets bytes, out of `.total_bytes`), then
    close both checkpoints. Imports torch."""
    from qtool.comparison import run_comparison
    from qtool.pipeline import resolve_device

    try:
        return run_comparison(comparison, device=resolve_device(device), on_progress=on_progress)
    finally:
        comparison.a.close()
        comparison.b.close()


def check(
    path: str | os.PathLike[str],
    rules: CheckRules | None = None,
    *,
    device: str = "cpu",
    on_progress: Callable[[int], None] | None = None,
    report_paths: Sequence[str | None] = (),
    overwrite_reports: bool | None = None,
) -> Audit:
    """Audit a checkpoint against `rules`; `.findings` lists what breaks them. Reads the header
    only, unless `rules.no_nan` asks for the data. `report_paths`: where the caller will write
    reports; refused (before the audit) where one is, or lies inside, the checkpoint."""
    from qtool.audit import CheckRules, audit

    rules = rules or CheckRules()
    rules.validate()
    if rules.no_nan:
        refuse_remote_data(path)
    checkpoint = _open_checkpoint(path)
    try:
        if any(p is not None for p in report_paths):
            refuse_report_paths([checkpoint], report_paths, overwrite=overwrite_reports)
        resolved = "cpu"
        if rules.no_nan:
            from qtool.pipeline import resolve_device

            checkpoint.require_local()
            resolved = resolve_device(device)
        result = audit(
            checkpoint, inspect_checkpoint(checkpoint).weights, rules, device=resolved, on_progress=on_progress
        )
        result.notes.extend(checkpoint.notes)
        return result
    finally:
        checkpoint.close()


# -- report files --------------------------------------------------------------------------------


def refuse_report_paths(
    checkpoints: Sequence[Checkpoint],
    paths: Sequence[str | None],
    *,
    overwrite: bool | None = None,
    text: str | os.PathLike[str] | None = None,
) -> None:
    """Refuse report paths that are, or lie inside, a path these checkpoints read (or the
    `text` an evaluation reads), or that name one file twice, or (`overwrite` False) that
    exist; before anything is measured."""
    from qtool.formats.loader import input_paths
    from qtool.report_output import refuse_report_paths as _refuse

    inputs: list[str] = [] if text is None else [os.path.realpath(text)]
    for checkpoint in checkpoints:
        if "://" not in checkpoint.path:
            inputs += input_paths(checkpoint)
    _refuse(inputs, [os.fspath(p) if p is not None else None for p in paths], overwrite=overwrite)


def overlay_document(documents: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several candidates' `compare` documents against one reference as one document, each kept
    exactly as `compare A B --json` prints it (qtool.comparison_overlay)."""
    from qtool.comparison_overlay import overlay_document as _overlay

    return _overlay(documents)


def write_report(
    path: str | os.PathLike[str],
    kind: str,
    documents: Sequence[dict[str, Any]],
    *,
    html: bool | None = None,
    overwrite: bool = False,
) -> None:
    """Write a report file atomically: `kind` is quantize, compare, check or eval, `documents` their
    `to_json()` documents (compare: one per candidate against the same A, overlaid in HTML).
    JSON, or HTML where `html` says so or (None) the path ends in .html; eval: its one
    document."""
    from qtool.report_output import stage_report

    stage_report(os.fspath(path), kind, documents, html=html, overwrite=overwrite).commit()


def load_policy(path: str | os.PathLike[str] | None) -> Policy:
    """The rules of `check` and the gates of `compare` from a `qtool-policy.toml` (None: the
    empty policy), each checked; command-line options add to it (`with_check_options`, ...)."""
    from qtool.policy import load_policy as _load

    return _load(path)


# -- the schemes qtool writes ------------------------------------------------------------------


def schemes() -> dict[str, Any]:
    """The `qtool schemes` document: every scheme name `--scheme` takes, with its bits per
    weight (for a 4096x4096 bf16 weight; exact for a GGUF block type), the layout that writes
    it, and llama.cpp's file types with their bits on Llama-3-8B's shapes."""
    from qtool.planning.schemes import catalogue

    return catalogue()


def import_transformers_lean() -> None:
    """For a process given over to a calibrated command (the CLI's): import transformers with
    its torchao, HQQ, `kernels` and scipy integrations taken for absent, 0.09 GB less peak RSS
    where they are installed (`qtool.calibration.skeleton.import_transformers_lean`)."""
    from qtool.calibration.skeleton import import_transformers_lean as lean

    lean()
