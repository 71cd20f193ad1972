"""`qtool quantize`, `dequantize` and `schemes` end to end: every flag, every failure mode."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from tests.conftest import REPO, SAMPLES

runner = CliRunner()
TINY = SAMPLES / "tiny-llama"
SHARDED = SAMPLES / "tiny-llama-sharded"
LINEAR = [
    f"model.layers.{i}.{m}.weight"
    for i in range(2)
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def ok(*args):
    result = run(*args)
    assert result.exit_code == 0, result.output
    return result


def weights_of(path):
    return {w.name: w for w in qtool.inspect(path).weights}


def load_dir(path):
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    return tensors


@pytest.mark.parametrize(
    "scheme, label",
    [
        ("W4A16", "int4 sym g128"),
        ("W8A16", "int8 sym g128"),
        ("W4A16_ASYM", "int4 asym g128"),
        ("FP8", "fp8_e4m3 tensor"),
        ("FP8_DYNAMIC", "fp8_e4m3 channel"),
        ("FP8_BLOCK", "fp8_e4m3 block128x128"),
        ("NVFP4A16", "nvfp4 g16"),
        ("MXFP4A16", "mxfp4 g32"),
        ("int8", "int8 sym channel"),
        ("int4:g64:asym", "int4 asym g64"),
        ("int2:g64", "int2 sym g64"),
    ],
)
def test_quantize_then_inspect_and_dequantize(tmp_path, scheme, label):
    out = tmp_path / "out"
    ok("quantize", TINY, "-o", out, "--scheme", scheme, "-q")
    weights = weights_of(out)
    for name in LINEAR:
        assert weights[name].scheme.label == label, name
        assert weights[name].shape == weights_of(TINY)[name].shape
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert not weights[name].quantized
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"  # the model's config is carried over
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["quantization_config"]["quantization_status"] == "compressed"
    assert "lm_head" in config["quantization_config"]["ignore"]
    back = tmp_path / "back.safetensors"
    ok("dequantize", out, "-o", back, "-q")
    original, restored = load_file(str(TINY / "model.safetensors")), load_file(str(back))
    assert original.keys() == restored.keys()
    for name, tensor in original.items():
        assert restored[name].shape == tensor.shape and restored[name].dtype == torch.bfloat16
        if name not in LINEAR:
            assert torch.equal(restored[name], tensor)  # copied through, bit for bit
    x, y = original[LINEAR[0]].float(), restored[LINEAR[0]].float()
    assert 10 * math.log10(float((x * x).sum() / ((x - y) ** 2).sum())) > {"int2:g64": 5}.get(scheme, 15)


def test_report_sqnr_matches_an_independent_computation(tmp_path):
    out, report = tmp_path / "out", tmp_path / "report.json"
    ok("quantize", TINY, "-o", out, "--scheme", "W4A16", "--report", report, "-q")
    document = json.loads(report.read_text())
    assert document["schema_version"] == 1 and document["summary"]["quantized_weights"] == 14
    assert len(document["weights"]) == 14
    sqnrs = [w["sqnr_db"] for w in document["weights"]]
    assert sqnrs == sorted(sqnrs)  # worst first
    ok("dequantize", out, "-o", tmp_path / "back.safetensors", "--dtype", "f32", "-q")
    original, restored = load_file(str(TINY / "model.safetensors")), load_file(str(tmp_path / "back.safetensors"))
    signal = noise = 0.0
    for entry in document["weights"]:
        x, y = original[entry["name"]].double(), restored[entry["name"]].double()
        s, n = float((x * x).sum()), float(((x - y) ** 2).sum())
        assert entry["sqnr_db"] == pytest.approx(10 * math.log10(s / n), abs=1e-3)
        assert entry["rel_rmse"] == pytest.approx(math.sqrt(n / s), rel=1e-3)
        assert entry["max_abs_err"] == pytest.approx(float((x - y).abs().max()), rel=1e-5)
        assert entry["cosine"] == pytest.approx(float((x * y).sum() / (x.norm() * y.norm())), abs=1e-6)
        signal, noise = signal + s, noise + n
    assert document["summary"]["sqnr_db"] == pytest.approx(10 * math.log10(signal / noise), abs=1e-3)


def test_summary_table_shows_worst_ten_and_model_sqnr(tmp_path):
    result = ok("quantize", TINY, "-o", tmp_path / "out", "-f", "table", "-q")
    assert "Worst weights by SQNR" in result.stdout
    assert "SQNR, quantized weights" in result.stdout and "SQNR, all weights" in result.stdout
    assert result.stdout.count("int4 sym g128") == 10


def test_dry_run_writes_nothing_and_plans_exact_sizes(tmp_path):
    out = tmp_path / "out"
    result = ok(
        "quantize", TINY, "-o", out, "--scheme", "fp8:block128x128", "--ignore", "re:.*lm_head", "--dry-run", "--json"
    )
    assert not out.exists() and os.listdir(tmp_path) == []
    plan = json.loads(result.stdout)
    ok("quantize", TINY, "-o", out, "--scheme", "fp8:block128x128", "-q")
    written = {t.name: t for t in qtool.open_checkpoint(out).tensors.values()}
    planned = {t["name"]: t for w in plan["weights"] for t in w["tensors"]}
    assert planned.keys() == written.keys()
    for name, t in planned.items():
        assert (t["dtype"], tuple(t["shape"])) == (written[name].dtype.name, written[name].shape)
    assert plan["summary"]["bytes_after"] == sum(t.nbytes for t in written.values())
    table = ok("quantize", TINY, "-o", out, "--dry-run", "-f", "table").stdout
    assert "Plan:" in table and "bits per weight" in table


def test_ignore_include_and_tensor_scheme(tmp_path):
    ok("quantize", TINY, "-o", tmp_path / "a", "--ignore", "*.mlp.*", "-q")
    weights = weights_of(tmp_path / "a")
    assert (
        not weights["model.layers.0.mlp.up_proj.weight"].quantized
        and weights["model.layers.0.self_attn.q_proj.weight"].quantized
    )
    ok("quantize", TINY, "-o", tmp_path / "b", "--include", "re:.*q_proj", "--include", "lm_head.weight", "-q")
    quantized = {n for n, w in weights_of(tmp_path / "b").items() if w.quantized}
    assert quantized == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "lm_head.weight",
    }
    ok("quantize", TINY, "-o", tmp_path / "c", "--tensor-scheme", "re:.*down_proj=W8A16", "-q")
    weights = weights_of(tmp_path / "c")
    assert weights["model.layers.0.mlp.down_proj.weight"].scheme.label == "int8 sym g128"
    assert weights["model.layers.0.mlp.up_proj.weight"].scheme.label == "int4 sym g128"
    config = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert len(config["config_groups"]) == 2


def test_dtype_casts_the_unquantized_float_tensors(tmp_path):
    ok("quantize", TINY, "-o", tmp_path / "out", "--dtype", "f16", "-q")
    weights = weights_of(tmp_path / "out")
    assert weights["model.embed_tokens.weight"].dtype == "F16" and weights["model.norm.weight"].dtype == "F16"
    tensors = load_dir(tmp_path / "out")
    original = load_file(str(TINY / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], original["lm_head.weight"].to(torch.float16))


def test_output_follows_input_sharding_or_max_shard_size(tmp_path):
    ok("quantize", SHARDED, "-o", tmp_path / "a", "-q")
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    checkpoint = qtool.open_checkpoint(tmp_path / "a")
    assert set(index["weight_map"]) == set(checkpoint.tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in checkpoint.tensors.values())
    ok("quantize", TINY, "-o", tmp_path / "b", "--max-shard-size", "200KB", "-q")
    shards = [n for n in os.listdir(tmp_path / "b") if n.endswith(".safetensors")]
    assert len(shards) > 3
    assert all(os.path.getsize(tmp_path / "b" / n) < 200_000 + 150_000 for n in shards)  # a weight never splits
    assert qtool.inspect(tmp_path / "b").summary()["parameters"] == qtool.inspect(TINY).summary()["parameters"]


def test_single_file_output_describes_itself(tmp_path):
    out = tmp_path / "w4.safetensors"
    ok("quantize", TINY / "model.safetensors", "-o", out, "-q")
    checkpoint = qtool.open_checkpoint(out)
    config = json.loads(checkpoint.metadata["quantization_config"])
    assert config["quant_method"] == "compressed-tensors"
    assert os.listdir(tmp_path) == ["w4.safetensors"]
    assert weights_of(out)["model.layers.0.self_attn.q_proj.weight"].scheme.label == "int4 sym g128"


def test_already_quantized_input_needs_allow_requantize(tmp_path):
    ok("quantize", TINY, "-o", tmp_path / "w8", "--scheme", "W8A16", "-q")
    result = run("quantize", tmp_path / "w8", "-o", tmp_path / "w4")
    assert result.exit_code == 2 and "already quantized" in result.stderr and "--allow-requantize" in result.stderr
    assert not (tmp_path / "w4").exists()
    result = ok("quantize", tmp_path / "w8", "-o", tmp_path / "w4", "--allow-requantize", "-q")
    assert "warning: requantizing 14" in result.stderr
    assert weights_of(tmp_path / "w4")["model.layers.0.mlp.up_proj.weight"].scheme.label == "int4 sym g128"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--scheme", "W4A17"], "unknown scheme 'W4A17'"),
        (["--scheme", "int4:g100"], "100"),  # 256 inputs are not a multiple of 100
        (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "cuda:99"], "device cuda"),
        (["--max-shard-size", "lots"], "is not a size"),
        (["--dtype", "int3"], "is not a float dtype"),
        (["--tensor-scheme", "nonsense"], "is not PATTERN=SCHEME"),
        (["--ignore", "re:("], "invalid regex"),
        (["--layout", "bitsandbytes"], "cannot store"),
        (["--include", "nothing-matches"], "matches the selection"),
    ],
    ids=[
        "bad-scheme",
        "group-does-not-divide",
        "no-cuda",
        "bad-size",
        "bad-dtype",
        "bad-override",
        "bad-regex",
        "bad-format",
        "empty-selection",
    ],
)
def test_bad_options_give_one_line_and_leave_nothing(tmp_path, args, message):
    result = run("quantize", TINY, "-o", tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error: ") and message in lines[0], lines
    assert len(lines) <= 2 and "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == []


def test_did_you_mean(tmp_path):
    result = run("quantize", TINY, "-o", tmp_path / "out", "--scheme", "w4a61")
    assert "did you mean" in result.stderr and "W4A16" in result.stderr


@pytest.mark.parametrize("typed, meant", [("Q4_K_MM", "Q4_K_M"), ("iq4_xs_", "IQ4_XS"), ("q5_k_s", "Q5_K_S")])
def test_the_scheme_suggestions_include_llama_cpps_file_types(tmp_path, typed, meant):
    """issue 42 item 24: --scheme takes llama.cpp's file types, but its list and its guess did
    not know them ('Q4_K_MM': did you mean 'Q4_K'?)."""
    result = run("quantize", TINY, "-o", tmp_path / "out.gguf", "--scheme", typed)
    assert result.exit_code == 2
    hint = result.stderr.splitlines()[1]
    assert hint.startswith(f"hint: did you mean {meant!r}? valid: W8A16, ")
    assert "; llama.cpp file types: Q2_K, Q3_K_S, Q3_K_M" in hint and "IQ2_XXS" in hint and hint.endswith("(--scheme)")


def test_existing_output_and_the_input_itself_are_refused(tmp_path):
    (tmp_path / "out").mkdir()
    result = run("quantize", TINY, "-o", tmp_path / "out")
    assert result.exit_code == 2 and "already exists" in result.stderr and "--overwrite" in result.stderr
    result = run("quantize", TINY, "-o", TINY / "model.safetensors", "--overwrite")
    assert result.exit_code == 2 and "is the input" in result.stderr
    result = run("quantize", TINY, "-o", TINY / "sub", "--overwrite")
    assert result.exit_code == 2 and "inside the input" in result.stderr
    result = run("quantize", TINY, "-o", TINY, "--overwrite")
    assert result.exit_code == 2 and "is the input" in result.stderr
    ok("quantize", TINY, "-o", tmp_path / "out", "--overwrite", "-q")
    assert weights_of(tmp_path / "out")["model.layers.0.mlp.up_proj.weight"].quantized


@pytest.mark.parametrize("errno_name", ["ENOSPC", "EACCES"])
def test_a_failing_write_mid_run_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, errno_name):
    import errno

    real_pwrite = os.pwrite
    calls = {"n": 0}

    def flaky(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 5:  # the header and a few tensors get through, then the disk fails
            raise OSError(getattr(errno, errno_name), os.strerror(getattr(errno, errno_name)))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", flaky)
    result = run("quantize", TINY, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and os.strerror(getattr(errno, errno_name)) in result.stderr
    assert os.listdir(tmp_path) == []


def test_a_disk_too_small_for_the_output_fails_before_any_data_is_written(tmp_path, monkeypatch):
    """On Linux the writer reserves each shard's blocks (fallocate) first: ENOSPC comes before
    a single tensor byte is written, as one line with exit 2, and nothing is left behind."""
    import ctypes
    import errno

    from qtool.formats import writer

    if writer._fallocate is None:
        pytest.skip("no fallocate here (not Linux)")

    def full(fd, mode, offset, size):
        ctypes.set_errno(errno.ENOSPC)
        return -1

    writes = []
    real_pwrite = os.pwrite
    monkeypatch.setattr(writer, "_fallocate", full)
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: writes.append(offset) or real_pwrite(fd, data, offset))
    result = run("quantize", TINY, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2, result.output
    assert (
        result.stderr.startswith("error: ") and "cannot write: No space left on device" in result.stderr.splitlines()[0]
    )
    assert writes == [] and os.listdir(tmp_path) == []


def test_a_filesystem_without_fallocate_still_gets_its_output(tmp_path, monkeypatch):
    import ctypes
    import errno

    from qtool.formats import writer

    def unsupported(fd, mode, offset, size):
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1

    monkeypatch.setattr(writer, "_fallocate", unsupported)
    ok("quantize", TINY, "-o", tmp_path / "out", "-q")
    assert weights_of(tmp_path / "out")["model.layers.0.self_attn.q_proj.weight"].quantized


def test_dequantize_defaults_to_the_recorded_dtype(tmp_path):
    ok("quantize", TINY, "-o", tmp_path / "w4", "-q")
    config = json.loads((tmp_path / "w4" / "config.json").read_text())
    config["torch_dtype"] = "float16"
    (tmp_path / "w4" / "config.json").write_text(json.dumps(config))
    ok("dequantize", tmp_path / "w4", "-o", tmp_path / "back", "-q")
    assert weights_of(tmp_path / "back")["model.layers.0.mlp.up_proj.weight"].dtype == "F16"
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())


def test_schemes_lists_every_name_with_bits_and_layout():
    document = json.loads(ok("schemes", "--json").stdout)
    by_name = {s["name"]: s for s in document["schemes"]}
    for name in (
        "W8A16",
        "W4A16",
        "W4A16_ASYM",
        "FP8",
        "FP8_DYNAMIC",
        "FP8_BLOCK",
        "NVFP4A16",
        "MXFP4A16",
        "int8",
        "int4:g128",
        "int4:g64:asym",
        "int2:g64",
        "fp8_e4m3:channel",
        "fp8:block128x128",
        "nf4:g64",
        "mxfp4",
        "nvfp4",
    ):
        assert name in by_name
    assert by_name["W4A16"]["bits_per_weight"] == pytest.approx(4 + 16 / 128)
    assert by_name["W4A16"]["layout"] == "compressed-tensors"
    assert by_name["nf4:g64"]["layout"] == "bitsandbytes"
    assert "W4A16" in ok("schemes", "-f", "table").stdout


def test_quantize_in_a_real_process(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "qtool",
            "quantize",
            str(TINY),
            "-o",
            str(tmp_path / "out"),
            "--scheme",
            "int8",
            "--report",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("weight\tscheme\tSQNR dB")  # not a terminal: TSV
    assert result.stderr == ""  # no progress bar off a terminal
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["sqnr_db"] > 35


@pytest.mark.parametrize("scheme", ["W4A16_ASYM", "int8", "FP8_BLOCK", "int2:g64", "W4A16"])
def test_row_chunked_encoding_is_identical_to_whole_weights(tmp_path, monkeypatch, scheme):
    import qtool.layouts.compressed_tensors as ct

    ok("quantize", TINY, "-o", tmp_path / "whole", "--scheme", scheme, "--report", tmp_path / "whole.json", "-q")
    monkeypatch.setattr(ct, "CHUNK_ELEMENTS", 1)  # the smallest chunk each scheme allows
    monkeypatch.setenv("QTOOL_NATIVE", "0")  # the torch encoder is the one that chunks
    weight = next(w for w in qtool.inspect(TINY).weights if w.name.endswith("q_proj.weight"))  # 256 rows
    assert ct.CompressedTensors().row_chunk(weight, qtool.scheme_strings.parse_scheme(scheme)) is not None
    ok("quantize", TINY, "-o", tmp_path / "chunked", "--scheme", scheme, "--report", tmp_path / "chunked.json", "-q")
    assert (tmp_path / "whole" / "model.safetensors").read_bytes() == (
        tmp_path / "chunked" / "model.safetensors"
    ).read_bytes()
    whole, chunked = (json.loads((tmp_path / f"{n}.json").read_text())["weights"] for n in ("whole", "chunked"))
    for a, b in zip(sorted(whole, key=lambda w: w["name"]), sorted(chunked, key=lambda w: w["name"])):
        assert a["sqnr_db"] == b["sqnr_db"]  # float64 sums over other slices: the same 9 digits


@pytest.mark.parametrize(
    "scheme, gguf_type",
    [("q8_0", "Q8_0"), ("q4_0", "Q4_0"), ("q4_1", "Q4_1"), ("q5_0", "Q5_0"), ("q5_1", "Q5_1"), ("mxfp4", "MXFP4")],
)
def test_quantize_to_gguf_through_the_cli(tmp_path, scheme, gguf_type):
    import gguf

    out = tmp_path / "model.gguf"
    ok("quantize", TINY, "-o", out, "--layout", "gguf", "--scheme", scheme, "--report", tmp_path / "r.json", "-q")
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_v.weight"] == gguf_type and types["blk.0.attn_norm.weight"] == "F32"
    doc = json.loads(ok("inspect", out, "--json").stdout)
    assert doc["format"] == "gguf" and "gguf" in doc["conventions"]
    assert doc["summary"]["parameters"] == qtool.inspect(TINY).summary()["parameters"]
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["sqnr_db"] > 15
    ok("dequantize", out, "-o", tmp_path / "back.safetensors", "-q")
    restored = load_file(str(tmp_path / "back.safetensors"))
    reference = gguf.quants.dequantize(
        next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight").data,
        reader.tensors[0].tensor_type.__class__[gguf_type],
    )
    # written back under its Hugging Face name (v_proj's rows are not permuted)
    assert torch.equal(
        restored["model.layers.0.self_attn.v_proj.weight"].float(),
        torch.from_numpy(reference.copy()).bfloat16().float(),
    )


def test_gguf_output_errors(tmp_path):
    result = run("quantize", TINY, "-o", tmp_path / "model.gguf", "--scheme", "W4A16")
    assert result.exit_code == 2 and "GGUF" in result.stderr
    result = run("quantize", TINY, "-o", tmp_path / "out", "--layout", "gguf", "--scheme", "q4_0")
    assert result.exit_code == 2 and "should end in .gguf" in result.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("native", ["1", "0"])
def test_empty_one_row_and_odd_width_weights(tmp_path, monkeypatch, native):
    """An empty Linear weight is copied (nothing to quantize), never a crash; one row and an
    in_features that packs into a partial int32 word quantize on either kernel path."""
    from safetensors.torch import save_file

    monkeypatch.setenv("QTOOL_NATIVE", native)
    tensors = {
        "a.q_proj.weight": torch.randn(0, 128).to(torch.bfloat16),
        "b.q_proj.weight": torch.randn(1, 128).to(torch.bfloat16),
        "c.q_proj.weight": torch.randn(7, 99).to(torch.bfloat16),
    }
    save_file(tensors, tmp_path / "in.safetensors")
    ok("quantize", tmp_path / "in.safetensors", "-o", tmp_path / "q", "--scheme", "int8", "-q")
    weights = weights_of(tmp_path / "q")
    assert not weights["a.q_proj.weight"].quantized and weights["a.q_proj.weight"].shape == (0, 128)
    assert weights["b.q_proj.weight"].quantized and weights["c.q_proj.weight"].shape == (7, 99)
    ok("dequantize", tmp_path / "q", "-o", tmp_path / "back.safetensors", "-q")
    back = load_file(str(tmp_path / "back.safetensors"))
    for name in ("b.q_proj.weight", "c.q_proj.weight"):
        error = (back[name].float() - tensors[name].float()).norm() / tensors[name].float().norm()
        assert error < 0.02, (name, error)
