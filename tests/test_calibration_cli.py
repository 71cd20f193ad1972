"""`qtool quantize --calibrate` through a real process: a run writes a calibrated
compressed-tensors checkpoint and reports each layer; every bad input is one `error:` line,
exit 2, no traceback and nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from tests.conftest import REPO, SAMPLES

TINY = SAMPLES / "tiny-llama"
TEXT = "An iterator is created for the result of the expression list. " * 40


def run_qtool(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "QTOOL_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "qtool", *map(str, args)], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )


def test_a_calibrated_run_reports_each_layer(tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": TEXT[i::3]}) for i in range(3)) + "\n")
    out = tmp_path / "out"
    result = run_qtool(
        "quantize",
        TINY,
        "-o",
        out,
        "--scheme",
        "int4:g64:asym",
        "--calibrate",
        text,
        "--samples",
        "4",
        "--seq-len",
        "32",
        "--threads",
        "1",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["calibration"]["algorithm"] == "gptq"
    assert (document["calibration"]["samples"], document["calibration"]["seq_len"]) == (4, 32)
    assert [layer["layer"] for layer in document["calibration"]["layers"]] == [0, 1]
    assert "calibrated layer 2/2" in result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 64


def _no_tokenizer(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(TINY / name, folder / name)
    return folder


def _unknown_architecture(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "nosucharch"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _gguf(tmp_path):
    path = tmp_path / "model.gguf"
    result = run_qtool("quantize", TINY, "-o", path, "--scheme", "q8_0", "-q")
    assert result.returncode == 0, result.stderr
    return path


CASES = {
    # id: (model maker, text, extra args, the error line's words)
    "empty text": (None, "", (), "the calibration text is empty"),
    "too few tokens": (
        None,
        "a few words",
        ("--samples", "4", "--seq-len", "512"),
        "the calibration text has 18 tokens, fewer than samples x seq_len = 4 x 512 = 2048",
    ),
    "no tokenizer": (_no_tokenizer, TEXT, (), "has no tokenizer"),
    "unknown architecture": (
        _unknown_architecture,
        TEXT,
        (),
        "architecture 'nosucharch' is not known to this transformers",
    ),
    "gguf input": (
        _gguf,
        TEXT,
        ("--allow-requantize",),
        "is a gguf checkpoint; calibration reads a Hugging Face model folder",
    ),
    "quantized input": (
        lambda tmp_path: SAMPLES / "tiny-llama-w4a16",
        TEXT,
        ("--allow-requantize",),
        "calibration needs float weights",
    ),
    "unknown algorithm": (
        None,
        TEXT,
        ("--algorithm", "smoothquant"),
        "algorithm 'smoothquant' is not one of gptq, awq, rtn",
    ),
    "float scheme": (
        None,
        TEXT,
        ("--scheme", "FP8"),
        "GPTQ and AWQ calibrate int2..int8 per channel or per group, not fp8_e4m3",
    ),
    "no such text": (None, None, (), "no such calibration text"),
    "actorder group": (
        None,
        TEXT,
        ("--actorder", "group"),
        "activation order 'group' (columns regrouped, a weight_g_idx per weight) is gone from compressed-tensors",
    ),
    "unknown actorder": (
        None,
        TEXT,
        ("--actorder", "sideways"),
        "activation order 'sideways' is not one of weight, static, none",
    ),
    "actorder with awq": (
        None,
        TEXT,
        ("--actorder", "weight", "--algorithm", "awq"),
        "an activation order orders GPTQ's columns; awq has none to order",
    ),
    "true sequential with awq": (
        None,
        TEXT,
        ("--true-sequential", "--algorithm", "awq"),
        "true sequential orders GPTQ's Linears; awq quantizes each layer from its float run",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_inputs_are_one_line_exit_2_and_write_nothing(tmp_path, case):
    make, text, extra, words = CASES[case]
    model = make(tmp_path) if make else TINY
    text_path = tmp_path / "text.txt"
    if text is not None:
        text_path.write_text(text)
    out = tmp_path / "out"
    result = run_qtool(
        "quantize", model, "-o", out, "--calibrate", text_path, "--samples", "4", "--seq-len", "32", *extra
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_an_algorithm_without_text_is_refused(tmp_path):
    result = run_qtool("quantize", TINY, "-o", tmp_path / "out", "--algorithm", "gptq")
    assert result.returncode == 2 and "an algorithm needs calibration text" in result.stderr
    result = run_qtool("quantize", TINY, "-o", tmp_path / "out", "--true-sequential")
    assert result.returncode == 2 and "true sequential GPTQ needs calibration text" in result.stderr


def test_true_sequential_is_recorded_in_the_report_and_changes_the_codes(tmp_path):
    """--true-sequential: the JSON report says so, and the codes differ from the two-run
    default's (o_proj and the MLP see other inputs); the first Linears (q/k/v of layer 0) see
    the same inputs either way, so their codes are the same."""
    import torch
    from safetensors.torch import load_file

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    outs, reports = {}, {}
    for mode in ((), ("--true-sequential",)):
        out = outs[mode] = tmp_path / ("ts" if mode else "default")
        result = run_qtool(
            "quantize", TINY, "-o", out, "--calibrate", text, "--samples", "4", "--seq-len", "32", "--json", *mode
        )
        assert result.returncode == 0, result.stderr
        reports[mode] = json.loads(result.stdout)["calibration"]
    assert reports[("--true-sequential",)]["true_sequential"] is True and "true_sequential" not in reports[()]
    default, sequential = (load_file(str(outs[mode] / "model.safetensors")) for mode in outs)
    assert torch.equal(
        default["model.layers.0.self_attn.q_proj.weight_packed"],
        sequential["model.layers.0.self_attn.q_proj.weight_packed"],
    )
    assert not torch.equal(
        default["model.layers.0.mlp.down_proj.weight_packed"], sequential["model.layers.0.mlp.down_proj.weight_packed"]
    )


def test_actorder_is_recorded_in_the_config_and_changes_the_codes(tmp_path):
    """GPTQ orders its columns by default as llm-compressor 0.14's GPTQModifier does ("static",
    recorded in the config); `--actorder none` keeps the stored order and records nothing."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    outs = {}
    for order in ("weight", "none", None):
        out = outs[order] = tmp_path / f"out-{order}"
        extra = ("--actorder", order) if order else ()
        result = run_qtool(
            "quantize",
            TINY,
            "-o",
            out,
            "--scheme",
            "int4:g32",
            "--calibrate",
            text,
            "--samples",
            "4",
            "--seq-len",
            "32",
            "--threads",
            "1",
            "-q",
            *extra,
        )
        assert result.returncode == 0, result.stderr

    def weight_args(order):
        return json.loads((outs[order] / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
            "weights"
        ]

    assert weight_args("weight")["actorder"] == "weight"
    assert weight_args(None)["actorder"] == "static"
    assert "actorder" not in weight_args("none")
    from safetensors.torch import load_file

    ordered, plain, default = (load_file(str(outs[order] / "model.safetensors")) for order in ("weight", "none", None))
    assert set(ordered) == set(plain)  # the same tensors: no weight_g_idx
    name = "model.layers.0.self_attn.q_proj.weight_packed"
    assert not ordered[name].equal(plain[name])
    assert all(ordered[key].equal(default[key]) for key in ordered)  # static is weight's alias
    # compressed-tensors (through transformers) reads the recorded order and decompresses the
    # weights exactly as qtool does
    import torch
    import transformers

    plain_out = tmp_path / "dequantized"
    assert run_qtool("dequantize", outs["weight"], "-o", plain_out, "-q").returncode == 0
    ours = load_file(str(plain_out / "model.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        outs["weight"],
        dtype=torch.bfloat16,
        quantization_config=transformers.CompressedTensorsConfig(run_compressed=False),
    )
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(
        json.loads((outs["weight"] / "config.json").read_text())["quantization_config"]
    )
    assert config.config_groups["group_0"].weights.actorder == "weight"
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        assert torch.equal(loaded.get_submodule(module).weight.detach(), ours[module + ".weight"]), module


def test_the_mse_observer_chooses_the_calibrated_scales_and_is_recorded(tmp_path):
    """`--observer mse` reaches GPTQ (other scales than min-max's) and `--algorithm rtn` (the
    plain path: qtool.kernels.mse's search on the stored weights), and the config says so."""
    import torch
    from safetensors.torch import load_file

    from qtool.kernels.mse import choose_qparams_mse

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    outs = {}
    for algorithm, observer in (("gptq", "mse"), ("gptq", "minmax"), ("rtn", "mse")):
        out = outs[algorithm, observer] = tmp_path / f"out-{algorithm}-{observer}"
        common = (
            "--scheme",
            "int3:g32",
            "--calibrate",
            text,
            "--samples",
            "4",
            "--seq-len",
            "32",
            "--threads",
            "1",
            "-q",
        )
        result = run_qtool("quantize", TINY, "-o", out, *common, "--algorithm", algorithm, "--observer", observer)
        assert result.returncode == 0, result.stderr
    weights = json.loads((outs["gptq", "mse"] / "config.json").read_text())["quantization_config"]["config_groups"][
        "group_0"
    ]["weights"]
    assert weights["observer"] == "mse"
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors = {key: load_file(str(out / "model.safetensors")) for key, out in outs.items()}
    assert not torch.equal(tensors["gptq", "mse"][name], tensors["gptq", "minmax"][name])
    original = load_file(str(TINY / "model.safetensors"))[
        "model.layers.1.mlp.down_proj.weight"
    ]  # as the layer holds it
    expected, _ = choose_qparams_mse(original, (1, 32), "int3", True, tensors["rtn", "mse"][name].dtype)
    assert torch.equal(tensors["rtn", "mse"][name], expected)


PEAK_SCRIPT = r"""
import json, sys

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


def library_pages():  # shared libraries' code pages resident (torch's linalg faults in ~40 MiB of libtorch_cpu.so)
    total, library = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and ":" in head[3]:
            library = len(head) == 6 and ".so" in head[5]
        elif library and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total

from qtool.calibration.skeleton import LEFT_OUT, import_transformers_lean

import_transformers_lean()
from transformers import AutoTokenizer  # noqa: F401  (what the run imports, before the baseline)
from transformers.models.llama import modeling_llama  # noqa: F401
base, base_libraries = status("VmRSS"), library_pages()
sys.argv = ["qtool", *sys.argv[1:]]
from qtool.calibration import request
from qtool.cli import main

calibrated = {}
apply = request.apply


def measured(*args, **kwargs):  # the peak up to the end of calibration, before the executor writes
    result = apply(*args, **kwargs)
    calibrated["peak"] = status("VmHWM") - (library_pages() - base_libraries)  # what the run holds, not code
    return result


request.apply = measured
try:
    main()
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "base": base, "peak": calibrated.get("peak", 0), "left_out": sorted(n for n in LEFT_OUT if n in sys.modules)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_calibrated_run_holds_neither_the_whole_embedding_nor_transformers_optional_integrations(tmp_path):
    """A model whose float32 embedding (65536 x 512: 128 MiB) dwarfs its layers (7 MiB each):
    the calibration's peak RSS above what its imports take stays far below the embedding's size
    (the embedding step reads the samples' rows only; it read the whole embedding before: 239
    MiB), and transformers' torchao, HQQ, `kernels` and scipy integrations were never imported.
    Shared libraries' code pages are not counted: GPTQ's first linear algebra faults in about 40
    MiB of libtorch_cpu.so, which is code the kernel can drop, not data the run holds (CI saw 73
    MiB with them)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=65536, hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, model / name)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = [
        "quantize",
        model,
        "-o",
        tmp_path / "out",
        "--scheme",
        "int4:g64",
        "--calibrate",
        text,
        "--samples",
        "4",
        "--seq-len",
        "32",
        "--threads",
        "1",
        "-q",
    ]
    env = {k: v for k, v in os.environ.items() if k != "QTOOL_DEBUG"}
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout.strip().splitlines()[-1])
    assert document["code"] in (0, None), result.stderr
    assert document["left_out"] == []
    grown = (document["peak"] - document["base"]) / 2**20
    assert 0 < grown < 64, f"peak RSS {grown:.0f} MiB above the imports"
