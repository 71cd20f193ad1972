"""`qtool check`: each rule with a case that passes and one that fails, the policy file, the
exit-code contract, and the README's CI example run verbatim in a real shell."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from tests.conftest import CT_FIXTURES, REPO, SAMPLES

runner = CliRunner()
TINY = SAMPLES / "tiny-llama"
DOWN = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)]
LINEAR = r"re:.*_proj\.weight"


def check(*args):
    result = runner.invoke(app, ["check", *(str(a) for a in args), "--json"])
    assert result.exit_code in (0, 1), result.output
    document = json.loads(result.stdout)
    assert result.exit_code == (0 if document["ok"] else 1)
    return document


def findings(*args) -> list[tuple[str, str | None]]:
    return [(f["rule"], f["weight"]) for f in check(*args)["findings"]]


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    out = tmp_path_factory.mktemp("check") / "tiny-w4"
    qtool.quantize(TINY, out, "W4A16")
    return out


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    """down_proj left plain (and listed in the config's `ignore`)."""
    out = tmp_path_factory.mktemp("check") / "tiny-w4-partial"
    qtool.quantize(TINY, out, "W4A16", ignore=[r"re:.*down_proj.*"])
    return out


def edited(source, target, *, config=None, tensors=None):
    """A copy of a checkpoint folder with its config or tensors changed."""
    shutil.copytree(source, target)
    if config is not None:
        document = json.loads((target / "config.json").read_text())
        config(document["quantization_config"])
        (target / "config.json").write_text(json.dumps(document))
    if tensors is not None:
        stored = load_file(str(target / "model.safetensors"))
        tensors(stored)
        save_file(stored, target / "model.safetensors")
    return target


# -- header rules --------------------------------------------------------------------------------


def test_a_checkpoint_that_keeps_the_policy(w4):
    bits = qtool.inspect(w4).summary()["bits_per_weight"]
    result = runner.invoke(
        app,
        [
            "check",
            str(w4),
            "--expect-scheme",
            "W4A16",
            "--require-quantized",
            LINEAR,
            "--max-bits-per-weight",
            repr(bits),
            "--fail-on-unknown",
            "--json",
        ],
    )
    assert result.exit_code == 0 and result.stderr == ""
    document = json.loads(result.stdout)
    added = ("policy", "model", "weight_rows")  # issue 23: what the HTML report shows
    assert document["policy"]["max_bits_per_weight"] == bits and len(document["weight_rows"]) == 21
    assert document["model"]["bits_per_weight"] == round(bits, 4)
    assert {key: value for key, value in document.items() if key not in added} == {
        "schema_version": 1,
        "path": str(w4),
        "ok": True,
        "rules": [
            "require-quantized",
            "expect-scheme",
            "max-bits-per-weight",
            "fail-on-unknown",
            "targeted-but-plain",
            "ignored-but-quantized",
            "missing-member",
        ],
        "weights": 21,
        "findings": [],
    }


def test_expect_scheme(w4, partial):
    assert findings(w4, "--expect-scheme", "int4:g128") == []  # a short form of the same scheme
    document = check(w4, "--expect-scheme", "W8A16")
    assert len(document["findings"]) == 14
    assert document["findings"][0] == {
        "rule": "expect-scheme",
        "weight": "model.layers.0.mlp.down_proj.weight",
        "detail": "int4 sym g128, expected int8 sym g128",
    }
    # a selected (linear) weight left plain breaks it too, unless --allow-plain says so
    document = check(partial, "--expect-scheme", "W4A16")
    assert [f["weight"] for f in document["findings"]] == DOWN
    assert document["findings"][0]["detail"] == "stored plain (BF16), expected int4 sym g128"
    assert findings(partial, "--expect-scheme", "W4A16", "--allow-plain", "*.down_proj.weight") == []


def test_expect_scheme_on_gguf_reads_llama_names(tmp_path):
    gguf = tmp_path / "tiny-q8_0.gguf"
    qtool.quantize(TINY, gguf, "q8_0", layout="gguf")
    assert findings(gguf, "--expect-scheme", "q8_0") == []  # token_embd and output are not linear layers
    assert len(findings(gguf, "--expect-scheme", "q4_0")) == 14


def test_require_quantized(w4, partial):
    assert findings(w4, "--require-quantized", LINEAR) == []
    document = check(partial, "--require-quantized", LINEAR)
    assert [(f["rule"], f["weight"]) for f in document["findings"]] == [("require-quantized", w) for w in DOWN]
    assert document["findings"][0]["detail"] == f"stored plain (BF16), but --require-quantized '{LINEAR}' matches it"
    assert findings(partial, "--require-quantized", LINEAR, "--allow-plain", "re:.*down_proj") == []
    assert findings(w4, "--require-quantized", "lm_head.weight") == [("require-quantized", "lm_head.weight")]


def test_max_bits_per_weight_fires_exactly_at_its_threshold(w4):
    bits = qtool.inspect(w4).summary()["bits_per_weight"]  # what inspect reports, 4 decimals
    assert findings(w4, "--max-bits-per-weight", repr(bits)) == []
    document = check(w4, "--max-bits-per-weight", repr(math.nextafter(bits, 0)))
    [finding] = document["findings"]
    assert finding["rule"] == "max-bits-per-weight" and finding["weight"] is None
    assert finding["detail"].startswith(f"{bits:.4f} bits per weight, more than {math.nextafter(bits, 0):g}; ")


def test_max_bits_per_weight_names_the_plain_weights_that_cost_the_bits(w4):
    """issue 42 item 24: on a small model the embeddings and head, kept plain, are most of the
    bytes, and the finding said only the figure. It names the largest plain weights, with their
    share of the checkpoint's bytes."""
    inspection = qtool.inspect(w4)
    total = sum(t.nbytes for t in inspection.checkpoint.tensors.values())
    plain = sorted((w for w in inspection.weights if not w.quantized), key=lambda w: -w.nbytes)
    share = round(100 * sum(w.nbytes for w in plain) / total)
    [finding] = check(w4, "--max-bits-per-weight", "4.5")["findings"]
    largest = ", ".join(f"{w.name} ({100 * w.nbytes / total:.0f}%)" for w in plain[:3])
    assert finding["detail"].endswith(f"; plain weights hold {share}% of the bytes, the largest {largest}")
    assert plain[0].name in ("model.embed_tokens.weight", "lm_head.weight")


def test_fail_on_unknown(w4, tmp_path):
    assert findings(w4, "--fail-on-unknown") == []
    odd = edited(
        w4,
        tmp_path / "odd",
        tensors=lambda t: t.update(
            {"model.layers.0.mlp.up_proj.weight_scale": torch.ones(128, 3, dtype=torch.bfloat16)}
        ),
    )
    document = check(odd, "--fail-on-unknown")
    unknown = [f for f in document["findings"] if f["rule"] == "fail-on-unknown"]
    assert {f["weight"] for f in unknown} == {
        f"model.layers.0.mlp.up_proj.{leaf}" for leaf in ("weight_packed", "weight_scale", "weight_shape")
    }
    assert "weight_scale shape [128, 3] does not fit a [128, 256] weight" in unknown[0]["detail"]


# -- the coverage audit against the checkpoint's own quantization_config -----------------------------


def test_targeted_but_plain(partial, tmp_path):
    assert findings(partial) == []  # qtool's config targets the quantized modules and ignores the rest

    def llm_compressor_style(config):
        config["ignore"] = ["lm_head"]
        config["config_groups"]["group_0"]["targets"] = ["Linear"]

    mislabelled = edited(partial, tmp_path / "mislabelled", config=llm_compressor_style)
    document = check(mislabelled)
    assert [(f["rule"], f["weight"]) for f in document["findings"]] == [("targeted-but-plain", w) for w in DOWN]
    assert document["findings"][0]["detail"] == "stored plain (BF16), but the config's group targets it ('Linear')"
    assert findings(mislabelled, "--allow-plain", "re:.*down_proj") == []


def test_the_packages_own_checkpoints_pass_the_coverage_audit():
    for name in ("W4A16", "W4A16_ASYM", "FP8_BLOCK", "NVFP4A16", "W8A8"):
        document = check(CT_FIXTURES / name)
        assert document["ok"] and "targeted-but-plain" in document["rules"], name


def test_ignored_but_quantized_honours_re_exactly_as_compressed_tensors(w4, tmp_path):
    def ignoring(entry):
        return edited(w4, tmp_path / f"ignore{len(os.listdir(tmp_path))}", config=lambda c: c["ignore"].append(entry))

    document = check(ignoring(r"re:.*mlp\.down_proj"))
    assert [(f["rule"], f["weight"]) for f in document["findings"]] == [("ignored-but-quantized", w) for w in DOWN]
    label = (
        qtool.inspect(tmp_path / "ignore0").weights[3].scheme.label
    )  # without its config group, g128 on 128 inputs reads as channel
    assert (
        document["findings"][0]["detail"]
        == label + r", but the config's ignore entry 're:.*mlp\.down_proj' lists model.layers.0.mlp.down_proj"
    )
    assert findings(ignoring("mlp.down_proj")) == []  # not a substring match
    assert findings(ignoring(r"re:mlp\.down_proj")) == []  # re.match: anchored at the start
    assert findings(ignoring("model.layers.1.mlp.down_proj")) == [("ignored-but-quantized", DOWN[1])]  # an exact name


def test_ignore_matching_agrees_with_the_package():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.utils.match import match_name

    from qtool.conventions.compressed_tensors import _Config

    modules = ["model.layers.0.mlp.down_proj", "model.layers.10.self_attn.q_proj", "lm_head", "model.embed_tokens"]
    entries = [
        r"re:.*mlp\.down_proj",
        "mlp.down_proj",
        r"re:mlp\.down_proj",
        "lm_head",
        r"re:.*layers\.1\..*",
        r"re:.*layers\.1.*",
        "re:.*(q|k)_proj$",
    ]
    for entry in entries:
        config = _Config({"ignore": [entry], "config_groups": {}})
        for module in modules:
            assert (config.ignored_by(module) is not None) == match_name(module, entry), (entry, module)


def test_missing_member(w4, tmp_path):
    no_scale = edited(w4, tmp_path / "no-scale", tensors=lambda t: t.pop("model.layers.0.mlp.down_proj.weight_scale"))
    document = check(no_scale)
    assert document["findings"] == [{
        "rule": "missing-member", "weight": DOWN[0],
        "detail": "weight_packed is stored (I32) but weight_scale is missing (targeted by 'model.layers.0.mlp.down_proj')",
    }]  # fmt: skip
    no_shape = edited(
        w4, tmp_path / "no-shape", tensors=lambda t: t.pop("model.layers.1.self_attn.q_proj.weight_shape")
    )
    assert findings(no_shape) == [("missing-member", "model.layers.1.self_attn.q_proj.weight")]
    asym = CT_FIXTURES / "W4A16_ASYM"  # written by compressed-tensors: group_0 asymmetric
    assert findings(asym) == []
    no_zero = edited(
        asym, tmp_path / "no-zero", tensors=lambda t: t.pop("model.layers.0.self_attn.q_proj.weight_zero_point")
    )
    document = check(no_zero)
    assert [(f["rule"], f["weight"]) for f in document["findings"]] == [
        ("missing-member", "model.layers.0.self_attn.q_proj.weight")
    ]
    assert "without weight_zero_point" in document["findings"][0]["detail"]


# -- data ----------------------------------------------------------------------------------------


def test_no_nan_streams_the_data_dequantized_first(w4, tmp_path, monkeypatch):
    assert findings(w4, "--no-nan") == []
    plain = tmp_path / "plain"
    plain.mkdir()
    tensors = load_file(str(TINY / "model.safetensors"))
    tensors["model.norm.weight"][7] = float("nan")
    tensors["lm_head.weight"][0, :2] = float("inf")
    save_file(tensors, plain / "model.safetensors")
    document = check(plain, "--no-nan")
    assert document["findings"] == [
        {"rule": "no-nan", "weight": "lm_head.weight", "detail": "0 NaN and 2 Inf values (stored)"},
        {"rule": "no-nan", "weight": "model.norm.weight", "detail": "1 NaN and 0 Inf values (stored)"},
    ]

    # an Inf scale: the packed data is finite, the weight it decodes to is not
    def inf_scale(stored):
        stored["model.layers.0.self_attn.q_proj.weight_scale"][5, 1] = float("inf")

    scaled = edited(w4, tmp_path / "inf-scale", tensors=inf_scale)
    document = check(scaled, "--no-nan")
    [finding] = document["findings"]
    nan, inf = map(
        int, re.fullmatch(r"(\d+) NaN and (\d+) Inf values \(after dequantizing\)", finding["detail"]).groups()
    )
    assert (
        finding["weight"] == "model.layers.0.self_attn.q_proj.weight" and nan + inf == 128
    )  # one group: inf * 0 is NaN

    # without --no-nan no tensor data is read at all
    from qtool.formats.checkpoint import Checkpoint

    monkeypatch.setattr(Checkpoint, "load", lambda self, tensor: pytest.fail(f"read {tensor.name}"))
    assert findings(scaled, "--expect-scheme", "W4A16", "--fail-on-unknown", "--require-quantized", LINEAR) == []


# -- policy file, exit codes -----------------------------------------------------------------------


def test_policy_file_holds_the_same_rules(partial, tmp_path):
    policy = tmp_path / "qtool-policy.toml"
    policy.write_text(f"[check]\nexpect-scheme = 'W4A16'\nrequire-quantized = ['{LINEAR}']\nfail-on-unknown = true\n")
    assert findings(partial, "--policy", policy) == findings(
        partial, "--expect-scheme", "W4A16", "--require-quantized", LINEAR, "--fail-on-unknown"
    )
    assert findings(partial, "--policy", policy) == [("require-quantized", w) for w in DOWN]
    assert findings(partial, "--policy", policy, "--allow-plain", "re:.*down_proj") == []  # options add to the file
    for text, message in [
        ("[chek]\n", "unknown section [chek] in the policy file"),
        ("[check]\nexpect-schema = 'W4A16'\n", "unknown key 'expect-schema' in [check]"),
        ("[check]\nmax-bits-per-weight = 'four'\n", "[check] max-bits-per-weight = 'four' should be a number"),
        ("[check\n", "the policy file is not valid TOML"),
    ]:
        policy.write_text(text)
        result = runner.invoke(app, ["check", str(partial), "--policy", str(policy)])
        assert result.exit_code == 2 and message in result.stderr, result.stderr


def test_exit_codes(w4, tmp_path):
    result = runner.invoke(app, ["check", str(w4), "--expect-scheme", "W8A16", "-f", "table"])
    assert result.exit_code == 1 and "Findings" in result.stdout
    assert result.stderr.splitlines()[0] == f"error: {w4}: 14 findings break the policy (expect-scheme ×14)"
    for args, message in [
        ([str(tmp_path / "nothing")], "error: "),
        ([str(w4), "--expect-scheme", "W5A16"], "unknown scheme 'W5A16'"),
        ([str(w4), "--allow-plain", "re:("], "invalid regex"),
    ]:
        result = runner.invoke(app, ["check", *args])
        assert result.exit_code == 2 and message in result.stderr


# -- the README's CI example, verbatim ---------------------------------------------------------------


def _readme_ci() -> tuple[list[str], str, list[tuple[str, int]]]:
    section = (REPO / "README.md").read_text().split("## Use in CI", 1)[1]
    workflow = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    steps = [line.split("run:", 1)[1].strip() for line in workflow.splitlines() if line.strip().startswith("- run:")]
    policy = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    shell = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    codes = [
        (line.split("#")[0].strip(), int(re.search(r"# exit (\d)", line).group(1)))
        for line in shell.splitlines()
        if line.strip()
    ]
    return steps, policy, codes


def test_the_readme_ci_example_runs_with_the_documented_exit_codes(tmp_path):
    steps, policy, codes = _readme_ci()
    assert steps[0] == "pip install qtool" and len(steps) == 4 and len(codes) == 4
    shutil.copytree(TINY, tmp_path / "model")
    (tmp_path / "qtool-policy.toml").write_text(policy)
    bin_dir = tmp_path / "bin"  # `qtool` on PATH: this interpreter's, whether or not pip installed the script
    bin_dir.mkdir()
    (bin_dir / "qtool").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m qtool "$@"\n')
    (bin_dir / "qtool").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    script = (
        "set -e\n"
        + "\n".join(steps[1:])
        + "\n"
        + "".join(f'set +e; {command}; echo "exit=$?"\n' for command, _ in codes)
    )
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.findall(r"exit=(\d)", result.stdout) == [str(code) for _, code in codes], result.stdout + result.stderr
    compare = json.loads((tmp_path / "compare.json").read_text())
    assert compare["ok"] and compare["gates"]["min_sqnr"] == 15.0 and compare["gates"]["max_missing"] == 0


# -- patterns that match nothing, hints, counts (issue 18 #12, #16) ---------------------------------


def test_a_require_quantized_pattern_that_matches_nothing_is_exit_2_naming_it(w4):
    """A typo in a CI gate would pass every model: the CLI, through a real process."""
    pattern = "re:.*\\.experts\\..*"
    result = subprocess.run(
        [sys.executable, "-m", "qtool", "check", str(w4), "--require-quantized", LINEAR, "--require-quantized", pattern],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    # issue 42 #12, #24: the rule as the flag and the policy file name it, the pattern as typed
    assert lines[0] == f"error: {w4}: require-quantized pattern '{pattern}' matches no weight"
    assert lines[1].startswith("hint: patterns match weight names") and lines[1].endswith("(--require-quantized)")
    assert len(lines) == 2 and result.stdout == ""


def test_an_allow_plain_pattern_that_matches_nothing_warns(w4):
    result = runner.invoke(app, ["check", str(w4), "--allow-plain", "nomatch*", "--json"])
    assert result.exit_code == 0, result.output
    assert "warning: allow-plain pattern 'nomatch*' matches no weight" in result.stderr
    result = runner.invoke(app, ["check", str(w4), "--allow-plain", "re:.*nomatch\\.x", "--json"])
    assert "warning: allow-plain pattern 're:.*nomatch\\.x' matches no weight" in result.stderr


def test_the_expect_scheme_hint_names_its_flag_once(w4):
    result = runner.invoke(app, ["check", str(w4), "--expect-scheme", "W5A16"])
    assert result.exit_code == 2
    assert "(--expect-scheme)" in result.stderr and "----" not in result.stderr
    assert result.stderr.splitlines()[0] == "error: expect-scheme: unknown scheme 'W5A16'"


def test_one_finding_is_singular(w4):
    result = runner.invoke(app, ["check", str(w4), "--require-quantized", "lm_head.weight", "-f", "table"])
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == f"error: {w4}: 1 finding breaks the policy (require-quantized ×1)"
    assert "1 finding" in result.stdout and "1 findings" not in result.stdout
