"""`qtool compare`: pairs by logical name (GGUF names too), SQNR against independent torch
computations, gates that fire exactly at their thresholds, findings, output."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.comparison import Gates
from qtool.errors import UsageError
from qtool.naming import gguf_to_hf, hf_to_gguf, parse_rename, rename
from tests.conftest import CT_FIXTURES, SAMPLES

runner = CliRunner()
TINY = SAMPLES / "tiny-llama"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "tiny-w4"
    qtool.quantize(TINY, out, "W4A16")
    return out


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "tiny-q8_0.gguf"
    qtool.quantize(TINY, out, "q8_0", layout="gguf")
    return out


@pytest.fixture(scope="module")
def w4_report(w4):
    return qtool.compare(TINY, w4).to_json()


def measures(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """The four measures in float64, straight from their definitions."""
    x, y = x.double().reshape(-1), y.double().reshape(-1)
    signal, noise = float((x * x).sum()), float(((x - y) ** 2).sum())
    return {
        "signal": signal,
        "noise": noise,
        "sqnr_db": 10 * math.log10(signal / noise),
        "rel_rmse": math.sqrt(noise / signal),
        "max_abs_err": float((x - y).abs().max()),
        "cosine": float((x * y).sum() / (x.norm() * y.norm())),
    }


def assert_matches(entry: dict, expected: dict) -> None:
    assert entry["sqnr_db"] == pytest.approx(expected["sqnr_db"], abs=1e-3), entry["name"]
    assert entry["rel_rmse"] == pytest.approx(expected["rel_rmse"], rel=1e-4)
    assert entry["max_abs_err"] == pytest.approx(expected["max_abs_err"], rel=1e-6)
    assert entry["cosine"] == pytest.approx(expected["cosine"], abs=1e-6)


# -- measures ----------------------------------------------------------------------------------


def test_sqnr_equals_an_independent_torch_computation(w4, w4_report, tmp_path):
    qtool.dequantize(w4, tmp_path / "back.safetensors", dtype="f32")
    original, restored = load_file(str(TINY / "model.safetensors")), load_file(str(tmp_path / "back.safetensors"))
    signal = noise = 0.0
    by_name = {w["name"]: w for w in w4_report["weights"]}
    assert len(by_name) == 21 and w4_report["only_in_a"] == w4_report["only_in_b"] == []
    for name, x in original.items():
        entry = by_name[name]
        if torch.equal(x.float(), restored[name].float()):  # norms, embeddings, lm_head: copied
            assert entry["exact"] and entry["sqnr_db"] is None and entry["scheme_b"] is None
            signal += float((x.double() ** 2).sum())
            continue
        expected = measures(x, restored[name])
        assert_matches(entry, expected)
        assert entry["scheme_a"] is None and entry["scheme_b"] == "int4 sym g128"
        signal, noise = signal + expected["signal"], noise + expected["noise"]
    summary = w4_report["summary"]
    assert summary["sqnr_db"] == pytest.approx(10 * math.log10(signal / noise), abs=1e-3)
    assert (summary["matched"], summary["measured"], summary["exact"], summary["findings"]) == (21, 21, 7, 0)
    sqnrs = [w["sqnr_db"] for w in w4_report["weights"] if not w["exact"]]
    assert sqnrs == sorted(sqnrs) and w4_report["weights"][-1]["exact"]  # worst first, exact last
    assert summary["worst"]["name"] == w4_report["weights"][0]["name"]
    histogram = summary["histogram"]
    assert sum(b["weights"] for b in histogram["bins"]) == 14 and histogram["exact"] == 7
    assert all(b["from_db"] <= s < b["to_db"] for s in sqnrs for b in histogram["bins"] if b["weights"] == 14)


def test_a_pair_written_by_compressed_tensors_itself(tmp_path):
    """The real package compresses; its own decompressor gives the reference values."""
    pytest.importorskip("compressed_tensors")
    from tests.fixtures import make_ct_fixtures as ct

    shapes, model, compressor, original = ct.make_quantized({"preset": "W4A16_ASYM"})
    quantized = tmp_path / "ct"
    quantized.mkdir()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        quantized / "model.safetensors",
        metadata={"format": "pt"},
    )
    compressor.update_config(str(quantized))
    (tmp_path / "orig").mkdir()
    save_file({k: v.contiguous() for k, v in original.items()}, tmp_path / "orig" / "model.safetensors")
    reference = ct.decompress_reference(quantized, shapes)

    report = qtool.compare(tmp_path / "orig", quantized).to_json()
    by_name = {w["name"]: w for w in report["weights"]}
    assert report["only_in_a"] == [] and set(report["only_in_b"]) == {
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
    }
    for name, values in reference.items():
        assert by_name[name]["scheme_b"] == "int4 asym g128"
        assert_matches(by_name[name], measures(original[name], values))
    assert by_name["lm_head.weight"]["exact"]  # the config ignores it


def test_qtool_decodes_the_packages_fixtures_exactly():
    """Matched by logical name across layouts: weight_packed/weight_scale against `.weight`."""
    for name in ("W4A16", "FP8_BLOCK", "NVFP4A16"):
        report = qtool.compare(CT_FIXTURES / name / "reference", CT_FIXTURES / name).to_json()
        assert report["ok"] and report["summary"]["findings"] == 0
        assert [w["exact"] for w in report["weights"]] == [True, True], name
        assert "lm_head.weight" in report["only_in_b"]


def test_strided_tensors_in_a_pytorch_pickle_are_read_through_the_container(tmp_path):
    """A strided view in a pickle has no byte range in its file: Checkpoint.read_bytes serves it."""
    source = CT_FIXTURES.parent / "torch" / "hf"
    if not source.is_dir():
        pytest.skip("no PyTorch pickle fixture")
    state = torch.load(source / "pytorch_model.bin", weights_only=True)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    report = qtool.compare(source, tmp_path / "model.safetensors").to_json()
    assert report["ok"] and all(w["exact"] for w in report["weights"]) and len(report["weights"]) == len(state)


# -- GGUF names and rotary rows ------------------------------------------------------------------


def test_gguf_is_matched_by_hugging_face_name_and_its_rotary_rows_are_undone(q8_gguf):
    import gguf

    report = qtool.compare(TINY, q8_gguf).to_json()
    assert report["summary"]["matched"] == 21 and report["only_in_a"] == report["only_in_b"] == []
    by_name = {w["name"]: w for w in report["weights"]}
    assert by_name["model.layers.0.self_attn.q_proj.weight"]["name_b"] == "blk.0.attn_q.weight"
    assert by_name["lm_head.weight"]["name_b"] == "output.weight" and by_name["lm_head.weight"]["exact"]

    reader = gguf.GGUFReader(str(q8_gguf))
    original = load_file(str(TINY / "model.safetensors"))
    for gguf_name, hf_name, heads in [
        ("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", 4),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", 2),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
    ]:
        tensor = next(t for t in reader.tensors if t.name == gguf_name)
        decoded = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        x = original[hf_name]
        if heads:  # llama.cpp's LlamaModel.permute, applied to the original instead
            x = x.reshape(heads, 2, x.shape[0] // heads // 2, x.shape[1]).swapaxes(1, 2).reshape(x.shape)
        assert_matches(by_name[hf_name], measures(x, decoded))
        assert by_name[hf_name]["sqnr_db"] > 40
        assert any("un-permuted" in n for n in by_name[hf_name]["notes"]) == bool(heads)

    # without the built-in map, a --map pairs q_proj, but nothing undoes the permutation
    raw = qtool.compare(
        TINY, q8_gguf, gguf_names=False, maps=[r"re:^blk\.(\d+)\.attn_q\.=model.layers.\1.self_attn.q_proj."]
    ).to_json()
    paired = {w["name"]: w for w in raw["weights"]}
    assert set(paired) == {f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)}
    assert paired["model.layers.1.self_attn.q_proj.weight"]["sqnr_db"] < 3


def test_the_gguf_name_map_agrees_with_gguf_py():
    import gguf

    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    for name in load_file(str(TINY / "model.safetensors")):
        expected = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert hf_to_gguf(name) == expected and gguf_to_hf(expected) == name, name
    assert gguf_to_hf("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_to_hf("rope_freqs.weight") == "rope_freqs.weight"


# -- rename rules --------------------------------------------------------------------------------


def test_rename_rules():
    rules = [
        parse_rename(r"re:^blk\.(\d+)\.=model.layers.\1."),
        parse_rename("model.layers.=layers."),
        parse_rename(r"re:(?=x)x=y"),
    ]
    assert rename("blk.12.attn_q.weight", rules) == "layers.12.attn_q.weight"  # in order, chained
    assert rename("xblk.1.w", rules[:1]) == "xblk.1.w"  # anchored at the start
    assert rename("x.blk", rules[2:]) == "y.blk"  # split at the last '=', so (?=...) works
    for bad, message in [
        ("no-equals", "is not OLD=NEW"),
        ("re:(=x", "invalid regex"),
        (r"re:^a(b)=\2", "invalid group reference 2"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_rename(bad)


def test_a_map_that_merges_two_names_is_refused(w4):
    result = run("compare", TINY, w4, "--map", r"re:model\.layers\.\d+\.=layer.")
    assert result.exit_code == 2 and "both become" in result.stderr


# -- gates ---------------------------------------------------------------------------------------


def test_each_gate_fires_exactly_at_its_threshold(w4):
    comparison = qtool.compare(TINY, w4)
    report = comparison.to_json()
    worst = report["summary"]["worst"]
    worst_sqnr = worst["sqnr_db"]
    assert comparison.violations(Gates(min_sqnr=worst_sqnr)) == []
    breaches = comparison.violations(Gates(min_sqnr=math.nextafter(worst_sqnr, math.inf)))
    assert breaches == [
        f"{worst['name']}: SQNR {worst_sqnr:.9g} dB is below --min-sqnr {math.nextafter(worst_sqnr, math.inf):g}"
    ]

    rel = max(w["rel_rmse"] for w in report["weights"])
    assert comparison.violations(Gates(max_rel_rmse=rel)) == []
    lines = comparison.violations(Gates(max_rel_rmse=math.nextafter(rel, 0)))
    assert len(lines) == 1 and lines[0].startswith(f"{worst['name']}: relative RMSE {rel:.9g} is above --max-rel-rmse")


def test_gates_on_the_command_line_exit_1_with_one_line_per_breach(w4, w4_report, tmp_path):
    sqnrs = sorted(w["sqnr_db"] for w in w4_report["weights"] if not w["exact"])
    result = run("compare", TINY, w4, "--min-sqnr", repr(sqnrs[0]), "-q")
    assert result.exit_code == 0 and result.stderr == ""
    result = run("compare", TINY, w4, "--min-sqnr", repr(math.nextafter(sqnrs[2], math.inf)), "--json")
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [f"error: {line}" for line in json.loads(result.stdout)["violations"]]
    assert len(result.stderr.splitlines()) == 3 and all(
        "is below --min-sqnr" in line for line in result.stderr.splitlines()
    )

    # two weights missing from B, one extra: --max-missing counts both sides
    tensors = load_file(str(TINY / "model.safetensors"))
    del tensors["lm_head.weight"], tensors["model.norm.weight"]
    tensors["extra.weight"] = torch.zeros(4)
    (tmp_path / "b").mkdir()
    save_file(tensors, tmp_path / "b" / "model.safetensors")
    assert run("compare", TINY, tmp_path / "b", "--max-missing", "3").exit_code == 0
    result = run("compare", TINY, tmp_path / "b", "--max-missing", "2", "--json")
    document = json.loads(result.stdout)
    assert (
        result.exit_code == 1
        and document["only_in_a"] == ["lm_head.weight", "model.norm.weight"]
        and document["only_in_b"] == ["extra.weight"]
    )
    assert (
        result.stderr == "error: 3 weights have no counterpart (2 only in A, 1 only in B), more than --max-missing 2\n"
    )
    assert run("compare", TINY, tmp_path / "b").exit_code == 0  # reported, but no gate asked


def test_gates_from_a_policy_file(w4, w4_report, tmp_path):
    worst = w4_report["summary"]["worst"]["sqnr_db"]
    policy = tmp_path / "qtool-policy.toml"
    policy.write_text(f"[compare]\nmin-sqnr = {math.nextafter(worst, math.inf)!r}\nmax-missing = 0\n")
    result = run("compare", TINY, w4, "--policy", policy)
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1
    assert run("compare", TINY, w4, "--policy", policy, "--min-sqnr", repr(worst)).exit_code == 0  # the option wins
    policy.write_text("[compare]\nmin-sqrn = 20\n")
    result = run("compare", TINY, w4, "--policy", policy)
    assert (
        result.exit_code == 2
        and "unknown key 'min-sqrn' in [compare]" in result.stderr
        and "did you mean 'min-sqnr'" in result.stderr
    )


# -- findings ------------------------------------------------------------------------------------


def test_shape_mismatch_and_nan_are_findings(tmp_path):
    tensors = load_file(str(TINY / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"].T.contiguous()
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    (tmp_path / "b").mkdir()
    save_file(tensors, tmp_path / "b" / "model.safetensors")
    result = run("compare", TINY, tmp_path / "b", "--json")
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    first, second = document["weights"][:2]
    assert first["finding"] == "shape mismatch: A [256, 128], B [128, 256]" and first["sqnr_db"] is None
    assert second["finding"] == "non-finite values: B has 1 NaN/Inf values" and not second["exact"]
    assert document["summary"]["findings"] == 2 and document["summary"]["exact"] == 19
    assert document["summary"]["sqnr_db"] is None  # the 19 others are exact: model-wide, no error
    assert result.stderr.splitlines() == [
        "error: model.layers.0.mlp.down_proj.weight: shape mismatch: A [256, 128], B [128, 256]",
        "error: model.layers.1.mlp.up_proj.weight: non-finite values: B has 1 NaN/Inf values",
    ]


def test_pages_are_released_pair_by_pair(w4, monkeypatch):
    """Bounded memory: every member of both sides is released right after its pair."""
    from qtool.formats.checkpoint import Checkpoint

    events = []
    monkeypatch.setattr(Checkpoint, "release", lambda self, tensor: events.append(("release", tensor.name)))
    load = Checkpoint.load
    monkeypatch.setattr(
        Checkpoint, "load", lambda self, tensor: events.append(("load", tensor.name)) or load(self, tensor)
    )
    qtool.compare(TINY, w4)
    live = set()
    for kind, name in events:
        live.add(name) if kind == "load" else live.discard(name)
        assert len({n.rpartition(".")[0].removesuffix(".weight") for n in live}) <= 2, live
    assert live == set()
    assert all(".weight_" in n for k, n in events if k == "load")  # plain weights are streamed by pread, never mapped
    assert {n for k, n in events if k == "release"} >= {n for k, n in events if k == "load"}


def test_unreadable_input_and_bad_options_exit_2(w4, tmp_path):
    result = run("compare", TINY, tmp_path / "missing")
    assert result.exit_code == 2 and result.stderr.startswith("error: ")
    result = run("compare", TINY, w4, "--map", "nonsense")
    assert (
        result.exit_code == 2 and "map rule 'nonsense' is not OLD=NEW" in result.stderr and "(--map)" in result.stderr
    )
    assert run("compare", TINY, w4, "--max-missing", "-1").exit_code == 2


# -- output --------------------------------------------------------------------------------------


def test_table_tsv_and_json(w4, tmp_path):
    table = run("compare", TINY, w4, "-f", "table", "-q").stdout
    for text in ("worst first", "Summary", "model SQNR", "worst weight", "Per-weight SQNR", "exact", "int4 sym g128"):
        assert text in table, text
    shutil.copytree(TINY, tmp_path / "a")
    tensors = load_file(str(TINY / "model.safetensors"))
    tensors["only.in.a.weight"] = torch.ones(2)
    save_file(tensors, tmp_path / "a" / "model.safetensors")
    table = run("compare", tmp_path / "a", w4, "-f", "table").stdout
    assert "Only in A" in table and "only.in.a.weight" in table and "Only in B" not in table
    tsv = run("compare", TINY, w4).stdout.splitlines()
    assert tsv[0] == "weight\tshape\tA\tB\tSQNR dB\trel RMSE\tmax abs err\tcosine\tfinding" and len(tsv) == 22
    document = json.loads(run("compare", TINY, w4, "--json").stdout)
    assert document["schema_version"] == 1 and document["ok"] and document["violations"] == []
    assert set(document) >= {"a", "b", "device", "summary", "weights", "only_in_a", "only_in_b", "gates"}


# -- integer and boolean tensors (issue 18 #11) ---------------------------------------------------


def _with_buffers(folder, ids, mask):
    shutil.copytree(TINY, folder)
    tensors = load_file(str(TINY / "model.safetensors"))
    tensors["model.position_ids"], tensors["model.mask"] = ids, mask
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_integer_and_bool_tensors_are_compared_for_equality_outside_the_sqnr(w4, tmp_path):
    """An int64 0..511 buffer next to small float weights would add dB to the model figure."""
    ids, mask = torch.arange(512, dtype=torch.int64).reshape(1, 512), torch.tensor([True, False, True])
    a = _with_buffers(tmp_path / "a", ids, mask)
    b = tmp_path / "b"
    shutil.copytree(w4, b)
    tensors = load_file(str(b / "model.safetensors"))
    tensors["model.position_ids"], tensors["model.mask"] = ids.to(torch.int32), mask
    save_file(tensors, b / "model.safetensors")
    plain = qtool.compare(TINY, w4)
    with_buffers = qtool.compare(a, b)
    assert with_buffers.model_error().sqnr_db == pytest.approx(plain.model_error().sqnr_db, rel=1e-12)
    document = with_buffers.to_json()
    assert document["ok"] and document["summary"]["integer"] == {"compared": 2, "equal": 2}
    assert document["summary"]["measured"] == plain.to_json()["summary"]["measured"]
    by_name = {w["name"]: w for w in document["weights"]}
    assert by_name["model.position_ids"]["integer"] and by_name["model.position_ids"]["exact"]
    assert by_name["model.position_ids"]["sqnr_db"] is None
    # a changed integer value is a finding: exit 1 at the CLI
    tensors["model.position_ids"] = ids.clone().index_fill_(1, torch.tensor([7]), 8)
    save_file(tensors, b / "model.safetensors")
    result = run("compare", a, b, "--json")
    assert result.exit_code == 1, result.output
    assert "model.position_ids: integer values differ: 1 of 512" in json.loads(result.stdout)["violations"]


def test_minilm_compare_agrees_with_the_quantize_report(tmp_path):
    """all-MiniLM-L6-v2 holds an int64 position_ids: compare's model SQNR is the quantize
    report's all-weights figure (issue 18: it was 48.86 dB against 21.31 dB)."""
    import sys

    sys.path.insert(0, str(SAMPLES))
    from real_models import Unavailable, minilm

    try:
        source = minilm()
    except Unavailable as exc:
        pytest.skip(str(exc))
    report = qtool.quantize(source, tmp_path / "minilm-w4", "W4A16")
    comparison = qtool.compare(source, tmp_path / "minilm-w4")
    assert comparison.model_error().sqnr_db == pytest.approx(report.all_weights_error().sqnr_db, rel=1e-9)
    assert comparison.to_json()["summary"]["integer"] == {"compared": 1, "equal": 1}


# -- issue 42 #20: nothing compared is never a pass ------------------------------------------------


def _disjoint(tmp_path):
    """A GGUF dequantized back keeps GGUF names; against the Hugging Face original no name pairs."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.randn(8, 32)}, a)
    save_file({"blk.0.attn_q.weight": torch.randn(8, 32)}, b)
    return a, b


def _cli(*argv):
    import subprocess
    import sys

    from tests.conftest import REPO

    return subprocess.run(
        [sys.executable, "-m", "qtool", "compare", *map(str, argv)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def test_nothing_matched_is_exit_2_with_the_reason(tmp_path):
    a, b = _disjoint(tmp_path)
    for extra in ((), ("--json",)):
        result = _cli(a, b, *extra)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert lines[0].startswith("error: ") and "nothing was compared" in lines[0] and "1 in A, 1 in B" in lines[0], (
            lines
        )
        assert lines[1].startswith("hint: ") and "--map" in lines[1] and len(lines) == 2


def test_nothing_matched_under_a_gate_is_a_violation_and_no_figure_is_zero(tmp_path):
    a, b = _disjoint(tmp_path)
    result = _cli(a, b, "--json", "--max-missing", "5")
    assert result.returncode == 1, result.stderr
    document = json.loads(result.stdout)
    summary = document["summary"]
    assert document["ok"] is False and "nothing was compared" in document["violations"][0]
    assert summary["matched"] == summary["measured"] == 0
    assert [summary[k] for k in ("sqnr_db", "rel_rmse", "max_abs_err", "cosine")] == [None] * 4
    assert "nothing was compared" in result.stderr
    text = _cli(a, b, "--format", "table", "--max-missing", "5")
    assert text.returncode == 1
    facts = {line.split("  ")[0].strip(): line for line in text.stdout.splitlines() if line.strip()}
    assert "n/a" in facts["model SQNR"] and "n/a" in facts["model rel RMSE"], text.stdout
    assert "OK" not in facts["result"]


def test_a_comparison_of_nothing_reports_no_figures():
    from types import SimpleNamespace

    from qtool.comparison import Comparison

    empty = Comparison(SimpleNamespace(path="a"), SimpleNamespace(path="b"), [], ["x"], ["y"], 1, 1)  # type: ignore[arg-type]
    document = empty.to_json()
    assert document["ok"] is False
    assert all(document["summary"][k] is None for k in ("sqnr_db", "rel_rmse", "max_abs_err", "cosine"))
