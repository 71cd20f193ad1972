"""`qtool inspect` through CliRunner and a real subprocess, and the JSON contract field by field."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from qtool.cli import app
from tests.conftest import CT_FIXTURES, REPO, SAMPLES

runner = CliRunner()
TINY = SAMPLES / "tiny-llama"
SHARDED = SAMPLES / "tiny-llama-sharded"
TRAPS = SAMPLES / "traps"


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def inspect_json(*args) -> dict:
    result = run("inspect", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# -- the JSON contract, schema version 1 --------------------------------------------------------

TOP = {"schema_version", "path", "format", "files", "metadata", "conventions", "summary", "weights"}
SUMMARY = {"tensors", "weights", "quantized_weights", "parameters", "bytes", "bits_per_weight", "by_dtype", "by_scheme"}
WEIGHT = {"name", "shape", "dtype", "parameters", "bytes", "bits_per_weight", "quantized", "scheme", "tensors", "notes"}
SCHEME = {
    "label",
    "qtype",
    "bits",
    "kind",
    "symmetric",
    "granularity",
    "block",
    "group_size",
    "scale_dtype",
    "zero_point",
    "convention",
    "details",
}


def test_json_contract_field_by_field_on_a_plain_model():
    doc = inspect_json(TINY)
    assert set(doc) == TOP
    assert doc["schema_version"] == 1
    assert doc["path"] == str(TINY)
    assert doc["format"] == "safetensors"
    assert doc["files"] == [str(TINY / "model.safetensors")]
    assert doc["metadata"] == {"format": "pt"}
    assert doc["conventions"] == ["plain"]
    summary = doc["summary"]
    assert set(summary) == SUMMARY
    assert summary["tensors"] == summary["weights"] == 21
    assert summary["quantized_weights"] == 0
    assert summary["parameters"] == sum(math.prod(w["shape"]) for w in doc["weights"]) == 722176
    assert summary["bytes"] == 2 * 722176
    assert summary["bits_per_weight"] == 16.0
    assert summary["by_dtype"] == {"BF16": {"tensors": 21, "bytes": 2 * 722176}}
    assert summary["by_scheme"] == {"plain": {"weights": 21, "parameters": 722176}}
    for w in doc["weights"]:
        assert set(w) == WEIGHT
        assert isinstance(w["name"], str) and all(isinstance(d, int) for d in w["shape"])
        assert w["dtype"] == "BF16" and w["quantized"] is False and w["scheme"] is None
        assert w["bytes"] == 2 * w["parameters"] and w["bits_per_weight"] == 16.0
        assert w["tensors"] == [{"name": w["name"], "role": "data", "dtype": "BF16", "shape": w["shape"]}]
        assert w["notes"] == []
    names = [w["name"] for w in doc["weights"]]
    assert names.index("model.layers.0.mlp.up_proj.weight") < names.index("model.layers.1.mlp.up_proj.weight")


def test_json_contract_on_a_quantized_weight():
    doc = inspect_json(CT_FIXTURES / "W4A16_ASYM")
    w = next(w for w in doc["weights"] if w["name"] == "model.layers.0.mlp.down_proj.weight")
    assert set(w["scheme"]) == SCHEME
    assert w["scheme"] == {
        "label": "int4 asym g128",
        "qtype": "int4",
        "bits": 4,
        "kind": "int",
        "symmetric": False,
        "granularity": "group",
        "block": [1, 128],
        "group_size": 128,
        "scale_dtype": "BF16",
        "zero_point": True,
        "convention": "compressed-tensors",
        "details": {"format": "pack-quantized"},
    }
    assert w["quantized"] is True
    roles = {t["role"]: t for t in w["tensors"]}
    assert roles["data"] == {
        "name": "model.layers.0.mlp.down_proj.weight_packed",
        "role": "data",
        "dtype": "I32",
        "shape": [12, 32],
    }
    summary = doc["summary"]
    assert summary["quantized_weights"] == 2
    assert summary["by_scheme"]["int4 asym g128"] == {"weights": 2, "parameters": 16 * 128 + 12 * 256}
    assert summary["tensors"] == sum(len(w["tensors"]) for w in doc["weights"])


def test_sharded_and_single_file_describe_the_same_model():
    single, sharded = inspect_json(TINY), inspect_json(SHARDED / "model.safetensors.index.json")
    assert single["summary"] == sharded["summary"]
    assert len(sharded["files"]) == 2
    assert [w["name"] for w in single["weights"]] == [w["name"] for w in sharded["weights"]]
    assert inspect_json(SHARDED)["summary"] == single["summary"]  # the folder finds its index


def test_traps_are_all_plain_and_never_crash():
    doc = inspect_json(TRAPS)
    dtypes = {w["name"]: w["dtype"] for w in doc["weights"]}
    assert dtypes["position_ids"] == "I64"
    assert dtypes["attention_mask"] == "U8"
    assert dtypes["lookup.table"] == "I8"
    assert dtypes["fp8.bare.weight"] == "F8_E4M3"
    assert all(w["scheme"] is None for w in doc["weights"])
    assert doc["summary"]["quantized_weights"] == 0


def test_every_safetensors_dtype_is_plain_and_readable(make_safetensors):
    from qtool.dtypes import DTYPES

    path = make_safetensors({f"t.{name}": (name, [4, 8]) for name in DTYPES})
    doc = inspect_json(path)
    assert {w["dtype"] for w in doc["weights"]} == set(DTYPES)
    assert all(w["scheme"] is None for w in doc["weights"])
    assert run("inspect", path, "-f", "table").exit_code == 0
    f4 = next(w for w in doc["weights"] if w["dtype"] == "F4")
    assert f4["parameters"] == 32 and f4["bytes"] == 16 and f4["bits_per_weight"] == 4.0


# -- output formats ------------------------------------------------------------------------------


def test_table_collapses_repeated_layers_and_shows_the_summary():
    out = run("inspect", TINY, "-f", "table").stdout
    assert "model.layers.[0-1].mlp.up_proj.weight ×2" in out
    assert "model.layers.0.mlp.up_proj.weight" not in out
    for heading in ("Summary", "Bytes by dtype", "Parameters by scheme", "Metadata"):
        assert heading in out
    assert "—" in out  # plain weights show a dash as their scheme


def test_no_collapse_lists_every_weight():
    out = run("inspect", TINY, "-f", "table", "--no-collapse").stdout
    assert "model.layers.0.mlp.up_proj.weight" in out and "model.layers.1.mlp.up_proj.weight" in out
    assert "×" not in out


def test_layers_that_differ_do_not_collapse(make_safetensors):
    path = make_safetensors({"m.layers.0.w.weight": ("BF16", [4, 4]), "m.layers.1.w.weight": ("F32", [4, 4])})
    out = run("inspect", path, "-f", "table").stdout
    assert "m.layers.0.w.weight" in out and "m.layers.1.w.weight" in out


def test_tsv_and_names_list_every_weight_by_its_real_name():
    tsv = run("inspect", TINY, "-f", "tsv").stdout.splitlines()
    assert tsv[0].split("\t") == ["name", "shape", "dtype", "scheme", "parameters", "size"]
    assert len(tsv) == 22
    row = dict(zip(tsv[0].split("\t"), next(line for line in tsv if line.startswith("model.norm.weight")).split("\t")))
    assert row == {
        "name": "model.norm.weight",
        "shape": "256",
        "dtype": "BF16",
        "scheme": "",
        "parameters": "256",
        "size": "512",
    }
    names = run("inspect", TINY, "-f", "names").stdout.splitlines()
    assert len(names) == 21 and "model.layers.1.self_attn.q_proj.weight" in names


def test_auto_format_is_tsv_when_not_a_terminal():
    assert run("inspect", TINY).stdout.startswith("name\tshape\t")


def test_filter_glob_and_regex():
    names = run("inspect", TINY, "-f", "names", "--filter", "*.q_proj.*").stdout.split()
    assert names == ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"]
    names = run("inspect", TINY, "-f", "names", "--filter", r"re:model\.layers\.1\..*proj").stdout.split()
    assert len(names) == 7 and all(n.startswith("model.layers.1.") for n in names)
    assert run("inspect", TINY, "-f", "names", "--filter", "re:lm_head").stdout.split() == ["lm_head.weight"]


def test_a_filter_that_matches_nothing_warns():
    """A typo in -k lists nothing, exit 0 (it is a listing, not a gate), and says so on stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "qtool", "inspect", str(TINY), "-k", "nomatch*", "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == f"warning: -k 'nomatch*' matches no weight in {TINY}\n"
    assert json.loads(result.stdout)["weights"] == []
    assert run("inspect", TINY, "-k", "*.q_proj.*").stderr == ""


def test_a_filtered_summary_is_the_filtered_weights(tmp_path):
    from tests.conftest import write_safetensors

    tensors = {
        "embeddings.weight": ("BF16", (4000, 64)),
        "pooler.dense.weight": ("BF16", (64, 64)),
        "pooler.dense.bias": ("BF16", (64,)),
    }
    path = write_safetensors(tmp_path / "m.safetensors", tensors)
    doc = inspect_json(path, "-k", "pooler*")
    summary = doc["summary"]
    assert [w["name"] for w in doc["weights"]] == ["pooler.dense.bias", "pooler.dense.weight"] and doc[
        "filter"
    ] == "pooler*"
    assert summary["bytes"] == sum(w["bytes"] for w in doc["weights"]) == 2 * (64 * 64 + 64)
    assert summary["bits_per_weight"] == 16.0 and summary["tensors"] == 2  # was 1000.6: the whole file's bytes
    assert summary["by_dtype"] == {"BF16": {"tensors": 2, "bytes": summary["bytes"]}}
    table = run("inspect", path, "-k", "pooler*", "-f", "table").stdout
    assert "16.000" in table and "stored tensors" in table
    raw = inspect_json(path, "-k", "pooler*", "--raw")  # the stored tensors of the weights kept
    assert [t["name"] for t in raw["tensors"]] == ["pooler.dense.weight", "pooler.dense.bias"]  # file order
    assert len(raw["tensors"]) == raw["summary"]["tensors"]
    quantized = inspect_json(CT_FIXTURES / "W4A16", "--raw", "-k", "*.down_proj.weight")
    names = sorted(t["name"] for t in quantized["tensors"])
    assert names and all(".down_proj.weight_" in n for n in names) and len(names) == quantized["summary"]["tensors"]


def test_bad_regex_is_a_usage_error():
    result = run("inspect", TINY, "--filter", "re:(")
    assert result.exit_code == 2 and result.stderr.startswith("error: invalid regex")


def test_raw_lists_stored_tensors_not_weights():
    tsv = run("inspect", CT_FIXTURES / "W4A16", "--raw", "-f", "tsv").stdout.splitlines()
    assert tsv[0].split("\t") == ["name", "dtype", "shape", "bytes", "file", "offset"]
    names = [line.split("\t")[0] for line in tsv[1:]]
    assert (
        "model.layers.0.mlp.down_proj.weight_packed" in names and "model.layers.0.mlp.down_proj.weight_scale" in names
    )
    doc = inspect_json(CT_FIXTURES / "W4A16", "--raw")
    assert len(doc["tensors"]) == doc["summary"]["tensors"]


def test_stats_match_torch(tmp_path):
    import torch
    from safetensors.torch import save_file

    values = torch.tensor([[1.0, -3.0, float("nan")], [float("inf"), 2.0, 0.5]], dtype=torch.float32)
    ints = torch.arange(-5, 5, dtype=torch.int64)
    save_file({"w": values, "ids": ints, "flags": torch.tensor([True, False, True])}, str(tmp_path / "m.safetensors"))
    doc = inspect_json(tmp_path / "m.safetensors", "--stats")
    stats = {w["name"]: w["stats"] for w in doc["weights"]}
    finite = torch.tensor([1.0, -3.0, 2.0, 0.5], dtype=torch.float64)
    assert stats["w"]["nan"] == 1 and stats["w"]["inf"] == 1
    assert stats["w"]["min"] == -3.0 and stats["w"]["max"] == 2.0 and stats["w"]["absmax"] == 3.0
    assert stats["w"]["mean"] == pytest.approx(float(finite.mean()))
    assert stats["w"]["std"] == pytest.approx(float(finite.std(unbiased=False)))
    assert stats["ids"]["min"] == -5 and stats["ids"]["max"] == 4 and stats["ids"]["mean"] == pytest.approx(-0.5)
    assert stats["flags"]["mean"] == pytest.approx(2 / 3)
    table = run("inspect", tmp_path / "m.safetensors", "--stats", "-f", "table").stdout
    assert "absmax" in table


def test_stats_stream_in_chunks(monkeypatch, tmp_path):
    import torch
    from safetensors.torch import save_file

    import qtool.value_stats

    monkeypatch.setattr(qtool.value_stats, "CHUNK", 7)  # many chunks, one partial: merging must be exact
    values = torch.randn(1000, dtype=torch.float64) * 3 + 10
    save_file({"w": values}, str(tmp_path / "m.safetensors"))
    stats = inspect_json(tmp_path / "m.safetensors", "--stats")["weights"][0]["stats"]
    assert stats["mean"] == pytest.approx(float(values.mean()), rel=1e-12)
    assert stats["std"] == pytest.approx(float(values.std(unbiased=False)), rel=1e-9)


def test_quantized_weights_get_no_stats():
    doc = inspect_json(CT_FIXTURES / "W4A16", "--stats")
    for w in doc["weights"]:
        assert (w["stats"] is None) == w["quantized"]


def test_help_shows_examples():
    result = run("inspect", "--help")
    assert result.exit_code == 0
    assert "qtool inspect model.safetensors --json | jq .summary" in result.stdout


def test_version():
    assert run("--version").stdout.startswith("qtool ")


# -- a real process --------------------------------------------------------------------------------


def _qtool(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "qtool", *map(str, args)], capture_output=True, text=True, env=env, cwd=REPO
    )


HEADER_ONLY = [
    TINY,
    CT_FIXTURES / "W4A16_ASYM",
    CT_FIXTURES / "NVFP4",
    SAMPLES / "tiny-llama-fp8",
    REPO / "tests" / "fixtures" / "bnb" / "nf4_nested",
]


@pytest.mark.parametrize("path", HEADER_ONLY, ids=lambda p: p.name)
def test_subprocess_json_pipes_and_imports_no_torch(path):
    if not path.exists():
        pytest.skip(f"{path} not present")
    code = (
        "import sys, runpy; sys.argv = ['qtool', 'inspect', %r, '--json'];\n"
        "try:\n    runpy.run_module('qtool', run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'heavy import on the inspect path'\n"
    ) % str(path)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["summary"]["weights"] > 0
    assert result.stderr == ""


def test_subprocess_console_script_exit_code_on_bad_input(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x01\x02")
    result = _qtool("inspect", bad)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines()[0] == f"error: {bad}: file is 2 bytes, shorter than the 8-byte header length"
    assert "Traceback" not in result.stderr


def test_require_scheme_on_a_plain_weight_names_the_weight_and_its_dtype():
    import qtool

    weight = next(w for w in qtool.inspect(TRAPS).weights if w.name == "lookup.table")
    with pytest.raises(qtool.NotQuantizedError, match=r"'lookup.table' is not quantized: it is a plain I8 tensor"):
        weight.require_scheme()
    quantized = next(w for w in qtool.inspect(CT_FIXTURES / "W4A16").weights if w.quantized)
    assert quantized.require_scheme().bits == 4
