"""`qtool quantize ... --imatrix FILE` (qtool/llamacpp/importance.py, layouts/gguf.py): each
tensor gets its entry's importance in its GgmlBlocks as llama-quantize matches them (by GGUF
name, per expert for a 3-D tensor, none for tensors the file lacks), the output records the file
in llama-quantize's quantize.imatrix.* keys, and an imatrix for another model, or with a
non-GGUF output, is one line, exit 2, nothing written. With llama-quantize built, the whole
output against `llama-quantize --imatrix` on the same GGUF and imatrix."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from types import SimpleNamespace

import gguf
import numpy as np
import pytest

from qtool import api
from qtool.errors import ImatrixError, SchemeError
from qtool.ggml_types import ggml_type_named
from qtool.formats.imatrix import ImatrixEntry, read_imatrix
from qtool.llamacpp.importance import attach_importance, imatrix_metadata
from qtool.llamacpp.mixes import MIXES, MixTensor, ModelFacts, choose_types, requires_imatrix
from qtool.plan import QUANTIZE, GgmlBlocks
from tests.conftest import REPO, SAMPLES
from tests.imatrix_files import TINY_DAT, TINY_GGUF, write_imatrix_gguf

TINY = SAMPLES / "tiny-llama"
IMATRIX_ONLY = ("IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS")  # llama-quantize makes these only with an imatrix
LLAMA_QUANTIZE = os.environ.get("LLAMA_QUANTIZE", "/work/llama/build/bin/llama-quantize")


def qtool(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qtool", *map(str, args)], cwd=REPO, capture_output=True, text=True, check=False
    )


def planned(imatrix, scheme="Q4_K_M", source=TINY, tmp=None):
    out = (tmp or "/tmp") + "/never-written.gguf"
    return api.prepare_quantize(source, out, scheme, imatrix=imatrix)


def test_every_quantized_tensor_gets_its_entrys_importance():
    plan = planned(TINY_GGUF)
    try:
        imatrix = read_imatrix(TINY_GGUF)
        weighted = {}
        for job in plan.jobs:
            if job.action != QUANTIZE:
                continue
            name = job.outputs[0].name
            weighted[name] = job.encoding.importance
            if name in imatrix.entries:
                assert job.encoding.importance.dtype == np.float32 and job.encoding.importance.shape == (
                    job.weight.shape[-1],
                )
                assert np.array_equal(job.encoding.importance, imatrix.entries[name].importance()), name
        assert (
            weighted["output.weight"] is None and weighted["token_embd.weight"] is None
        )  # llama-imatrix does not cover them
        assert sum(v is not None for v in weighted.values()) == 14
        assert any("14 of 16 quantized tensors weighted" in note for note in plan.warnings)
    finally:
        plan.source.close()


def test_the_output_records_the_imatrix_as_llama_quantize_does():
    plan = planned(str(TINY_GGUF))
    try:
        _, entries = plan.metadata
        assert entries[-4:] == [
            ("quantize.imatrix.file", str(TINY_GGUF).encode(), "STRING"),
            ("quantize.imatrix.dataset", b"topics.txt", "STRING"),
            ("quantize.imatrix.entries_count", 14, "UINT32"),
            ("quantize.imatrix.chunks_count", 4, "UINT32"),
        ]
    finally:
        plan.source.close()


def test_recorded_strings_are_cut_as_strncpy_cuts_them():
    imatrix = read_imatrix(TINY_DAT)
    long_name = "/d/" + "é" * 80 + ".dat"  # 163 bytes: cut at byte 127, inside a character
    recorded = imatrix_metadata(imatrix, long_name)
    assert recorded[0] == ("quantize.imatrix.file", long_name.encode()[:127], "STRING")
    no_chunks = SimpleNamespace(entries=imatrix.entries, datasets=(), chunk_count=0)
    assert [key for key, _, _ in imatrix_metadata(no_chunks, "x")] == [
        "quantize.imatrix.file",
        "quantize.imatrix.entries_count",
    ]


def test_a_legacy_dat_weighs_the_same_tensors_with_the_same_importance():
    plans = [planned(path) for path in (TINY_GGUF, TINY_DAT)]
    try:
        for a, b in zip(plans[0].jobs, plans[1].jobs, strict=True):
            if a.action == QUANTIZE and a.encoding.importance is not None:
                np.testing.assert_allclose(a.encoding.importance, b.encoding.importance, rtol=1e-6)
    finally:
        for plan in plans:
            plan.source.close()


@dataclasses.dataclass(frozen=True)
class _Job:  # what attach_importance reads of a plan's Job; it returns new ones, as for a Job
    action: str
    encoding: GgmlBlocks
    outputs: list
    weight: SimpleNamespace


def _job(name, shape, gguf_type="Q4_K"):
    return _Job(
        QUANTIZE,
        GgmlBlocks(ggml_type_named(gguf_type)),
        [SimpleNamespace(name=name, dtype=gguf_type)],
        SimpleNamespace(shape=shape),
    )


def test_a_3d_expert_tensor_takes_one_slice_per_expert():
    sums = np.arange(4 * 64, dtype=np.float32)
    imatrix = SimpleNamespace(
        path="m.gguf",
        entries={"blk.0.ffn_up_exps.weight": ImatrixEntry("blk.0.ffn_up_exps.weight", sums, (2, 0, 4, 8))},
    )
    job = _job("blk.0.ffn_up_exps.weight", (4, 128, 64))
    (weighted,), _ = attach_importance([job], imatrix, "Q4_K_M")
    assert job.encoding.importance is None  # the job given is not changed
    importance = weighted.encoding.importance
    assert importance.shape == (4, 64) and importance.dtype == np.float32
    assert np.array_equal(importance[0], sums[:64] / np.float32(2))
    assert np.array_equal(importance[1], np.ones(64, dtype=np.float32))  # no token reached expert 1
    assert np.array_equal(importance[3], sums[192:] / np.float32(8))


def test_a_width_mismatch_is_refused_but_token_embd_goes_without():
    entry = ImatrixEntry("blk.0.attn_q.weight", np.ones(128, dtype=np.float32), (3,))
    imatrix = SimpleNamespace(path="m.gguf", entries={"blk.0.attn_q.weight": entry, "token_embd.weight": entry})
    with pytest.raises(
        ImatrixError,
        match="entry blk.0.attn_q.weight holds 128 values, the weight has 256 columns: an importance matrix for another model",
    ):
        attach_importance([_job("blk.0.attn_q.weight", (256, 256))], imatrix, None)
    embd, q = _job("token_embd.weight", (1000, 256)), _job("blk.0.attn_q.weight", (256, 128))
    (embd, q), _ = attach_importance([embd, q], imatrix, None)
    assert embd.encoding.importance is None and q.encoding.importance is not None


def test_types_that_need_an_imatrix_are_refused_without_one():
    iq2_xs, q2_k = ggml_type_named("IQ2_XS"), ggml_type_named("Q2_K")
    assert requires_imatrix("blk.0.attn_q.weight", iq2_xs, None) and requires_imatrix(
        "blk.0.ffn_up.weight", q2_k, "Q2_K_S"
    )
    assert not requires_imatrix("token_embd.weight", iq2_xs, None) and not requires_imatrix(
        "blk.0.ffn_up.weight", q2_k, "Q2_K"
    )
    with pytest.raises(SchemeError, match="IQ2_XXS needs an importance matrix"):
        attach_importance([_job("blk.0.attn_q.weight", (256, 256), "IQ2_XXS")], None, None)
    imatrix = SimpleNamespace(
        path="m.gguf",
        entries={"blk.0.attn_k.weight": ImatrixEntry("blk.0.attn_k.weight", np.ones(256, dtype=np.float32), (3,))},
    )
    with pytest.raises(ImatrixError, match="has no entry for blk.0.attn_q.weight, whose type IQ2_XXS needs one"):
        attach_importance(
            [_job("blk.0.attn_k.weight", (256, 256)), _job("blk.0.attn_q.weight", (256, 256), "IQ2_XXS")], imatrix, None
        )


def test_with_an_imatrix_q4_0_puts_the_first_eighth_of_ffn_down_in_q4_1():
    """llama.cpp's guard, applied only when an imatrix is given (llama-quant.cpp)."""
    layers = 16
    tensors = [MixTensor(f"blk.{i}.ffn_down.weight", (256, 512), "F16") for i in range(layers)]
    facts = ModelFacts("llama", layers, 4, 4)
    plain = choose_types(MIXES["Q4_0"], tensors, facts)
    weighted = choose_types(MIXES["Q4_0"], tensors, facts, has_imatrix=True)
    assert {c.type for c in plain.values()} == {"Q4_0"}
    assert [weighted[f"blk.{i}.ffn_down.weight"].type for i in range(4)] == ["Q4_1", "Q4_1", "Q4_0", "Q4_0"]


def test_an_imatrix_for_another_model_is_one_line_exit_2_and_nothing_written(tmp_path):
    other = tmp_path / "other.gguf"
    write_imatrix_gguf(other, {f"blk.{i}.attn_q.weight": (np.ones(4096), [512]) for i in range(2)})
    out = tmp_path / "out.gguf"
    done = qtool("quantize", TINY, "-o", out, "--scheme", "Q4_K_M", "--imatrix", other, "-q")
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.splitlines()[0]
        == f"error: {other}: entry blk.0.attn_q.weight holds 4096 values, the weight has 256 columns: an importance matrix for another model?"
    )
    unrelated = tmp_path / "unrelated.gguf"
    write_imatrix_gguf(unrelated, {"blk.0.ssm_in.weight": (np.ones(256), [512])})
    done = qtool("quantize", TINY, "-o", out, "--scheme", "Q4_K_M", "--imatrix", unrelated, "-q")
    assert (
        done.returncode == 2
        and "none of its 1 entries (e.g. blk.0.ssm_in.weight) names a tensor this quantizes" in done.stderr
    )
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["other.gguf", "unrelated.gguf"]


def test_an_imatrix_with_a_non_gguf_output_is_one_line_exit_2(tmp_path):
    done = qtool("quantize", TINY, "-o", tmp_path / "w4", "--scheme", "W4A16", "--imatrix", TINY_GGUF, "-q")
    assert done.returncode == 2
    assert (
        done.stderr.splitlines()[0]
        == "error: an importance matrix weighs llama.cpp's GGUF quantizers; this writes compressed-tensors"
    )
    assert not (tmp_path / "w4").exists()


def test_a_bad_imatrix_file_is_refused_before_anything_is_written(tmp_path):
    bad = tmp_path / "bad.dat"
    bad.write_bytes(b"\x01\x00\x00\x00junk")
    done = qtool("quantize", TINY, "-o", tmp_path / "out.gguf", "--scheme", "Q4_K_M", "--imatrix", bad, "-q")
    assert done.returncode == 2 and done.stderr.startswith(f"error: {bad}: ") and "Traceback" not in done.stderr
    assert not (tmp_path / "out.gguf").exists()


# -- against llama-quantize --imatrix ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """sample_models/tiny-llama as a BF16 GGUF: the model llama-imatrix made the fixtures on."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    api.quantize(TINY, path, "Q8_0", ignore=["re:.*"])
    return path


def _fields(path) -> dict:
    out = {}
    for key, field in gguf.GGUFReader(str(path)).fields.items():
        if key.startswith("GGUF.") or key == "general.quantized_by":
            continue
        kinds = [t.name for t in field.types]
        value = bytes(field.parts[field.data[0]]) if kinds == ["STRING"] else field.contents()
        out[key] = (kinds, value)
    return out


@pytest.mark.skipif(not os.path.exists(LLAMA_QUANTIZE), reason="llama-quantize not built (set LLAMA_QUANTIZE)")
@pytest.mark.parametrize(
    "mix",
    [
        m
        for m in (
            "Q2_K",
            "Q3_K_S",
            "Q3_K_M",
            "Q3_K_L",
            "Q4_K_S",
            "Q4_K_M",
            "Q5_K_S",
            "Q5_K_M",
            "Q6_K",
            "Q4_0",
            "IQ4_XS",
            "IQ3_S",
            "IQ3_M",
            *IMATRIX_ONLY,
        )
        if m in MIXES
    ],
)
@pytest.mark.parametrize("imatrix", [TINY_GGUF, TINY_DAT], ids=["gguf", "dat"])
def test_the_output_equals_llama_quantize_imatrix(tiny_gguf, tmp_path, mix, imatrix):
    ours, theirs, plain = tmp_path / "qtool.gguf", tmp_path / "llama.gguf", tmp_path / "plain.gguf"
    api.quantize(tiny_gguf, ours, mix, imatrix=str(imatrix))
    done = subprocess.run(
        [LLAMA_QUANTIZE, "--imatrix", str(imatrix), str(tiny_gguf), str(theirs), mix, "1"],
        capture_output=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert _fields(ours) == _fields(theirs)  # the quantize.imatrix.* keys included, types too
    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    theirs_by_name = {t.name: t for t in b.tensors}
    assert sorted(theirs_by_name) == sorted(t.name for t in a.tensors)
    for tensor in a.tensors:
        assert tensor.tensor_type == theirs_by_name[tensor.name].tensor_type, tensor.name
    if mix in IMATRIX_ONLY:  # no output without an imatrix to compare with: the bytes must match
        for tensor in a.tensors:
            assert bytes(tensor.data) == bytes(theirs_by_name[tensor.name].data), tensor.name
        return
    api.quantize(tiny_gguf, plain, mix)
    weighted = [t.name for t in a.tensors if t.name in read_imatrix(imatrix).entries and t.tensor_type.name != "Q8_0"]
    plain_bytes = {t.name: bytes(t.data) for t in gguf.GGUFReader(str(plain)).tensors}
    if all(bytes(t.data) == plain_bytes[t.name] for t in a.tensors if t.name in weighted):
        pytest.skip("qtool's GGUF encoders do not weigh by the importance yet (the kernels branch of issue 21)")
    for tensor in a.tensors:
        assert bytes(tensor.data) == bytes(theirs_by_name[tensor.name].data), tensor.name


def _gguf_mix_reference():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_reference", REPO / "tests" / "fixtures" / "gguf_mix" / "make_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """Two models llama-imatrix cannot run (no tokenizer) with imatrices written by qtool's writer:
    8 experts per layer (per-expert counts, two experts no token reached), and 16 layers (the
    Q4_0 ffn_down guard reaches layers 0 and 1)."""
    from qtool.formats.imatrix import imatrix_gguf_bytes

    ref = _gguf_mix_reference()
    folder = tmp_path_factory.mktemp("synthetic")
    rng = np.random.default_rng(5)
    made = {}
    for name, spec in (
        ("moe8", dict(layers=2, hidden=256, heads=4, kv=4, ffn=256, tied=False, dtype="F16", experts=8)),
        ("deep16", dict(layers=16, hidden=256, heads=4, kv=2, ffn=512, tied=False, dtype="F16")),
    ):
        model = folder / f"{name}.gguf"
        ref.write_model(str(model), spec, seed=11)
        entries = {}
        for tensor, shape, _ in ref.tensors_of(spec):
            if not tensor.startswith("blk.") or len(shape) < 2 or "gate_inp" in tensor:
                continue
            experts = shape[0] if len(shape) == 3 else 1
            counts = [int(c) for c in rng.integers(0, 400, experts)]
            if experts > 1:
                counts[1] = counts[5] = 0
            sums = (rng.gamma(0.5, 2.0, experts * shape[-1]) * 64).astype(np.float32)
            entries[tensor] = (sums, counts)
        imatrix = folder / f"{name}-imatrix.gguf"
        imatrix.write_bytes(imatrix_gguf_bytes(entries, ["synthetic.txt"], 3, 128))
        made[name] = (model, imatrix)
    return made


@pytest.mark.skipif(not os.path.exists(LLAMA_QUANTIZE), reason="llama-quantize not built (set LLAMA_QUANTIZE)")
@pytest.mark.parametrize("model", ["moe8", "deep16"])
@pytest.mark.parametrize(
    "mix", [m for m in ("Q4_K_M", "Q2_K", "Q4_0", "IQ4_XS", "IQ3_XXS", "IQ2_M", "IQ2_XXS") if m in MIXES]
)
def test_expert_slices_and_the_imatrix_rules_equal_llama_quantize(synthetic, tmp_path, model, mix):
    source, imatrix = synthetic[model]
    ours, theirs = tmp_path / "qtool.gguf", tmp_path / "llama.gguf"
    api.quantize(source, ours, mix, imatrix=str(imatrix))
    done = subprocess.run(
        [LLAMA_QUANTIZE, "--imatrix", str(imatrix), str(source), str(theirs), mix, "1"],
        capture_output=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert _fields(ours) == _fields(theirs)
    a, b = gguf.GGUFReader(str(ours)), {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
    for tensor in a.tensors:
        assert tensor.tensor_type == b[tensor.name].tensor_type, tensor.name
        assert bytes(tensor.data) == bytes(b[tensor.name].data), tensor.name
    types = {t.name: t.tensor_type.name for t in a.tensors}
    if model == "deep16" and mix == "Q4_0":
        assert types["blk.1.ffn_down.weight"] == "Q4_1" and types["blk.2.ffn_down.weight"] == "Q4_0"


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"imatrix": TINY_GGUF, "calibrate": TINY_GGUF},
            "give either an importance matrix or calibration text, not both",
        ),
        (
            {"calibrate": TINY_GGUF, "algorithm": "gptq"},
            "algorithm 'gptq': a calibrated GGUF is weighed by llama.cpp's importance matrix",
        ),
    ],
)
def test_calibrated_gguf_options_that_contradict_are_refused(tmp_path, options, message):
    from qtool.errors import UsageError

    with pytest.raises(UsageError) as caught:
        api.prepare_quantize(TINY, tmp_path / "out.gguf", "Q4_K_M", **options)
    assert caught.value.message == message and caught.value.option in ("imatrix", "algorithm")


def test_the_output_may_not_be_the_imatrix(tmp_path):
    from qtool.errors import UsageError

    imatrix = tmp_path / "imatrix.gguf"
    imatrix.write_bytes(TINY_GGUF.read_bytes())
    with pytest.raises(UsageError, match="is the importance matrix"):
        api.prepare_quantize(TINY, imatrix, "Q4_K_M", imatrix=imatrix)


@pytest.mark.parametrize("mix", IMATRIX_ONLY)
def test_the_mixes_llama_cpp_makes_only_with_an_imatrix_are_refused_without_one(tmp_path, mix):
    out = tmp_path / "out.gguf"
    done = qtool("quantize", TINY, "-o", out, "--scheme", mix, "-q")
    assert done.returncode == 2, done.stderr
    first = done.stderr.splitlines()[0]
    assert (
        first.startswith("error: blk.0.") and "needs an importance matrix (llama.cpp refuses it without one)" in first
    )
    assert "Traceback" not in done.stderr and not out.exists() and os.listdir(tmp_path) == []


def test_calibrate_plans_a_mix_that_needs_an_imatrix(tmp_path):
    """--calibrate computes the importance after planning: the plan may not refuse for want of it."""
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    plan = api.prepare_quantize(TINY, tmp_path / "out.gguf", "IQ2_M", calibrate=text, samples=2, seq_len=64)
    try:
        types = {job.outputs[0].name: job.outputs[0].dtype for job in plan.jobs}
        assert types["blk.0.attn_q.weight"] == "IQ2_S" and all(
            job.encoding.importance is None for job in plan.jobs if job.action == QUANTIZE
        )
    finally:
        plan.source.close()
