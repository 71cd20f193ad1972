"""A stranger's model folder at the door to transformers (issue 42, items 1, 2, 5, 6): its own
code never runs and is never asked about; its config values reach neither transformers nor the
terminal unchecked; a config the weights belie is refused before any skeleton is built; a
tokenizer that panics is one line. Every CLI case runs in a real process with "y" waiting on
stdin, as a user who would answer transformers' prompt."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.conftest import REPO, SAMPLES

TINY = SAMPLES / "tiny-llama"
TEXT = "An iterator is created for the result of the expression list. " * 40
ESCAPES = "\x1b[2J\x1b]52;c;aGVsbG8=\x07\x1b]8;;http://evil.example/\x07click\x1b]8;;\x07"

EVIL = """\
import os
open(os.environ["QTOOL_TEST_MARKER"], "w").write("the folder's code ran")
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
class EvilConfig(LlamaConfig):
    model_type = "evilarch"
class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
"""


def run_qtool(tmp_path: Path, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "QTOOL_DEBUG"}
    env["QTOOL_TEST_MARKER"] = str(tmp_path / "MARKER")
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")  # where transformers would copy evil.py
    env["TRANSFORMERS_VERBOSITY"] = "warning"
    return subprocess.run(
        [sys.executable, "-m", "qtool", *map(str, args)], input="y\n", capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout
    )  # fmt: skip


def copy_of(tmp_path: Path, source: Path = TINY, name: str = "model") -> Path:
    folder = tmp_path / name
    shutil.copytree(source, folder)
    return folder


def edit_json(path: Path, **changes) -> None:
    value = json.loads(path.read_text())
    for key, new in changes.items():
        if new is None:
            value.pop(key, None)
        else:
            value[key] = new
    path.write_text(json.dumps(value))


def text_file(tmp_path: Path, text: str = TEXT) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(text)
    return path


def one_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def refused(call, *needles: str) -> str:
    """In this process (the CLI's cases above run it in their own): the QtoolError's line."""
    from qtool.errors import QtoolError

    with pytest.raises(QtoolError) as caught:
        call()
    assert caught.value.exit_code == 2
    line = str(caught.value)
    assert "\n" not in line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def prepare(tmp_path: Path, folder: Path, text: str = TEXT):
    """What `quantize --calibrate --dry-run` runs."""
    from qtool import api

    return lambda: api.prepare_quantize(
        folder, tmp_path / "out", "W4A16", calibrate=text_file(tmp_path, text), samples=2, seq_len=16
    )


def imatrix_api(tmp_path: Path, folder: Path, text: str = TEXT):
    from qtool import api

    return lambda: api.imatrix(folder, tmp_path / "imatrix.gguf", text_file(tmp_path, text), chunk_size=16, chunks=2)


def no_code_ran(tmp_path: Path, result: subprocess.CompletedProcess) -> None:
    assert not (tmp_path / "MARKER").exists(), "the model folder's code ran"
    assert not list((tmp_path / "modules").rglob("evil.py")), "evil.py was copied into transformers' module cache"
    assert "Do you wish to run the custom code" not in result.stdout + result.stderr
    assert "trust_remote_code" not in result.stdout + result.stderr
    if result.stdout.strip():
        json.loads(result.stdout)  # --json: the document, nothing before it


# -- item 1: the folder's own code ---------------------------------------------------------------


def evil_tokenizer(tmp_path: Path, source: Path = TINY) -> Path:
    folder = copy_of(tmp_path, source)
    (folder / "evil.py").write_text(EVIL)
    edit_json(
        folder / "tokenizer_config.json",
        tokenizer_class=None,
        auto_map={"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]},
    )
    return folder


def evil_architecture(tmp_path: Path) -> Path:
    folder = copy_of(tmp_path)
    (folder / "evil.py").write_text(EVIL)
    edit_json(
        folder / "config.json",
        model_type="evilarch",
        auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
    )
    return folder


def calibrate(tmp_path: Path, folder: Path, *extra: str, text: str = TEXT, timeout: float = 300):
    return run_qtool(
        tmp_path,
        "quantize",
        folder,
        "-o",
        tmp_path / "out",
        "--calibrate",
        text_file(tmp_path, text),
        "--samples",
        "2",
        "--seq-len",
        "16",
        "--json",
        *extra,
        timeout=timeout,
    )


def imatrix(tmp_path: Path, folder: Path, text: str = TEXT):
    return run_qtool(
        tmp_path,
        "imatrix",
        folder,
        "-o",
        tmp_path / "imatrix.gguf",
        "--calibrate",
        text_file(tmp_path, text),
        "--chunk-size",
        "16",
        "--chunks",
        "2",
        "--json",
    )


def calibrated_gguf(tmp_path: Path, folder: Path, text: str = TEXT):
    return run_qtool(
        tmp_path,
        "quantize",
        folder,
        "-o",
        tmp_path / "out.gguf",
        "--scheme",
        "Q4_K_M",
        "--calibrate",
        text_file(tmp_path, text),
        "--samples",
        "2",
        "--seq-len",
        "16",
        "--json",
    )


@pytest.mark.parametrize(
    "command", [calibrate, imatrix, calibrated_gguf], ids=["quantize-calibrate", "imatrix", "quantize-calibrate-gguf"]
)
def test_a_tokenizer_of_the_folders_own_code_is_refused_and_never_run(tmp_path, command):
    folder = evil_tokenizer(tmp_path)
    result = command(tmp_path, folder)
    one_error(result, f"{folder}/tokenizer_config.json", "names its own code for its tokenizer", "evil.EvilTokenizer")
    no_code_ran(tmp_path, result)
    assert not (tmp_path / "out").exists() and not (tmp_path / "imatrix.gguf").exists()


def test_an_architecture_of_the_folders_own_code_is_refused_and_never_run(tmp_path):
    folder = evil_architecture(tmp_path)
    result = calibrate(tmp_path, folder)
    one_error(result, f"{folder}/config.json", "names its own code for its architecture", "evil.")
    no_code_ran(tmp_path, result)
    refused(imatrix_api(tmp_path, folder), f"{folder}/config.json", "names its own code for its architecture")


def test_a_known_architecture_that_also_names_its_own_code_is_built_by_transformers(tmp_path):
    """auto_map beside a model_type transformers has: transformers' own LlamaForCausalLM, the
    folder's code neither run nor asked about."""
    folder = copy_of(tmp_path)
    (folder / "evil.py").write_text(EVIL)
    edit_json(
        folder / "config.json", auto_map={"AutoModelForCausalLM": "evil.EvilModel", "AutoConfig": "evil.EvilConfig"}
    )
    result = calibrate(tmp_path, folder, "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    no_code_ran(tmp_path, result)


def test_writing_a_gguf_tokenizer_never_runs_or_asks_about_the_folders_code(tmp_path):
    """The GGUF tokenizer writer reads a byte-level BPE tokenizer with transformers, from a
    staged copy of the tokenizer files; a Qwen2 folder whose tokenizer_config.json names its own
    class gets transformers' Qwen2 tokenizer, the folder's code neither run nor asked about."""
    from tests.test_gguf_hf import tiny_qwen2

    (tmp_path / "src").mkdir()
    source, _ = tiny_qwen2(tmp_path / "src")
    folder = evil_tokenizer(tmp_path, source)
    result = run_qtool(
        tmp_path,
        "quantize",
        folder,
        "-o",
        tmp_path / "out.gguf",
        "--scheme",
        "q8_0",
        "--allow-incomplete-gguf",
        "--json",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    no_code_ran(tmp_path, result)


def test_every_transformers_entry_point_passes_trust_remote_code_false():
    """The source says so where it calls transformers: no `from_pretrained`/`from_config`
    without it, and none with True."""
    calls = []
    for path in (REPO / "qtool").rglob("*.py"):
        text = path.read_text()
        for marker in (
            "AutoTokenizer.from_pretrained(",
            "AutoModelForCausalLM.from_config(",
            "AutoConfig.from_pretrained(",
            "AutoModel.from_pretrained(",
        ):
            start = 0
            while (at := text.find(marker, start)) >= 0:
                calls.append((path.name, text[at : text.find(")", at) + 1]))
                start = at + 1
    assert calls
    for name, call in calls:
        assert "trust_remote_code=TRUST" in call, (name, call)
    from qtool.formats.transformers_boundary import TRUST

    assert TRUST is False


# -- item 2: values from config.json on the terminal ---------------------------------------------


def test_an_escape_in_rope_type_is_refused_before_transformers_logs_it(tmp_path):
    folder = copy_of(tmp_path)
    edit_json(folder / "config.json", rope_scaling={"rope_type": ESCAPES, "factor": 2.0})
    result = calibrate(tmp_path, folder, "--dry-run")
    line = one_error(result, f"{folder}/config.json", "rope_type", "\\x1b[2J")
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    assert "\\\\x1b" not in line  # escaped once


def test_what_transformers_logs_is_a_warning_escaped_once(tmp_path):
    """An extra key in rope_scaling: transformers accepts the config and logs the key; the run
    goes on, the line is a qtool warning with the escape shown, never sent raw."""
    folder = copy_of(tmp_path)
    edit_json(folder / "config.json", rope_scaling={"rope_type": "linear", "factor": 2.0, f"x{ESCAPES}": 1})
    result = calibrate(tmp_path, folder, "--threads", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: transformers:")]
    assert warnings and any("\\x1b[2J" in line for line in warnings), result.stderr
    assert not [
        line
        for line in result.stderr.splitlines()
        if line.strip() and not line.startswith(("warning:", "calibrated layer"))
    ], result.stderr


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("hidden_act", "nosuch", "hidden_act is 'nosuch', not an activation transformers has"),
        ("hidden_act", 7, "hidden_act is 7, not an activation transformers has"),
        (
            "rope_scaling",
            {"rope_type": "sideways", "factor": 2.0},
            "rope_scaling names rope_type 'sideways', not one of default",
        ),
        ("rope_scaling", "linear", "rope_scaling is 'linear', not an object"),
    ],
)
def test_an_unknown_name_in_config_is_one_line_exit_2(tmp_path, field, value, words):
    folder = copy_of(tmp_path)
    edit_json(folder / "config.json", **{field: value})
    for call in (prepare, imatrix_api):
        refused(call(tmp_path, folder), f"{folder}/config.json", words)


def test_an_unknown_activation_through_the_cli(tmp_path):
    """It was a KeyError deep in the layer's constructor: exit 70."""
    folder = copy_of(tmp_path)
    edit_json(folder / "config.json", hidden_act="nosuch")
    one_error(imatrix(tmp_path, folder), f"{folder}/config.json", "hidden_act is 'nosuch'")


# -- item 5: a config the weights belie ------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("num_hidden_layers", 10**9, "num_hidden_layers is 1000000000, but the checkpoint holds 2 decoder layers"),
        ("num_hidden_layers", 1e9, "num_hidden_layers is 1000000000.0, but the checkpoint holds 2 decoder layers"),
        ("num_hidden_layers", 3, "num_hidden_layers is 3, but the checkpoint holds 2 decoder layers"),
        ("num_hidden_layers", 0, "num_hidden_layers is 0"),
        ("head_dim", 2**31, "head_dim is 2147483648, not a whole number from 1 to 256"),
        ("hidden_size", 2**31, "hidden_size is 2147483648, not a whole number from 1 to 256"),
        ("vocab_size", 0, "vocab_size is 0, not a whole number from 1 to 256"),
        ("num_attention_heads", True, "num_attention_heads is True"),
        (
            "intermediate_size",
            64,
            "has model.layers.0.mlp.gate_proj.weight of shape [64, 256], the checkpoint [128, 256]",
        ),
        ("vocab_size", 255, "has model.embed_tokens.weight of shape [255, 256], the checkpoint [256, 256]"),
    ],
)
def test_a_config_the_weights_belie_is_refused_in_dry_run(tmp_path, field, value, words):
    folder = copy_of(tmp_path)
    edit_json(folder / "config.json", **{field: value})
    refused(prepare(tmp_path, folder), f"{folder}/config.json", words)


def test_absurd_layers_through_the_cli_dry_run(tmp_path):
    """num_hidden_layers 10**9 built layers at +40 MB/s until memory ran out."""
    folder = copy_of(tmp_path)
    edit_json(folder / "config.json", num_hidden_layers=10**9)
    one_error(
        calibrate(tmp_path, folder, "--dry-run", timeout=120),
        f"{folder}/config.json",
        "num_hidden_layers is 1000000000",
    )


def test_the_config_check_takes_well_under_a_second(tmp_path):
    from qtool.calibration.skeleton import Skeleton
    from qtool.errors import CheckpointError
    from qtool.formats.loader import open_checkpoint

    Skeleton.build(open_checkpoint(str(TINY)))  # transformers imported, its Llama classes loaded
    for field, value in (
        ("num_hidden_layers", 10**9),
        ("head_dim", 2**31),
        ("hidden_size", 2**31),
        ("intermediate_size", 64),
    ):
        folder = copy_of(tmp_path, name=field)
        edit_json(folder / "config.json", **{field: value})
        checkpoint = open_checkpoint(str(folder))
        started = time.perf_counter()
        with pytest.raises(CheckpointError, match=field if field != "intermediate_size" else "gate_proj"):
            Skeleton.build(checkpoint)
        assert time.perf_counter() - started < 0.5, field


# -- item 6: a tokenizer that panics -------------------------------------------------------------


def backtracking_tokenizer(tmp_path: Path) -> Path:
    folder = copy_of(tmp_path)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {
        "type": "Split",
        "pattern": {"Regex": "(a|aa)+$"},
        "behavior": "Isolated",
        "invert": False,
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    edit_json(
        folder / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast"
    )  # the tokenizer.json as written
    return folder


BACKTRACKING_TEXT = ("a" * 40 + "b An iterator. ") * 50


def test_a_tokenizer_regex_that_panics_is_one_line_naming_the_tokenizer(tmp_path):
    folder = backtracking_tokenizer(tmp_path)
    result = calibrate(tmp_path, folder, text=BACKTRACKING_TEXT)
    one_error(result, f"{folder}/tokenizer.json", "the tokenizer failed on the text", "retry-limit")
    assert "PanicException" not in result.stderr
    refused(
        imatrix_api(tmp_path, folder, BACKTRACKING_TEXT), f"{folder}/tokenizer.json", "the tokenizer failed on the text"
    )


def test_a_panic_is_a_checkpoint_error_and_other_base_exceptions_pass():
    from qtool.errors import CheckpointError
    from qtool.formats.transformers_boundary import tokenizer_panics

    PanicException = type("PanicException", (BaseException,), {})  # pyo3_runtime's, by name
    with pytest.raises(CheckpointError, match="tokenizer.json: the tokenizer failed on the text \\(boom\\)"):
        with tokenizer_panics("m/tokenizer.json"):
            raise PanicException("boom")
    with pytest.raises(KeyboardInterrupt):
        with tokenizer_panics("m/tokenizer.json"):
            raise KeyboardInterrupt


def test_collected_keeps_loggers_and_warnings_as_they_were(capfd):
    import logging
    import warnings

    from qtool.formats.transformers_boundary import collected

    logger = logging.getLogger("transformers")
    handlers, propagate = logger.handlers[:], logger.propagate
    notes: list[str] = []
    with collected(notes, "transformers: "):
        logging.getLogger("transformers.models.llama").warning("value %s", ESCAPES)
        for _ in range(3):
            warnings.warn(f"torch says {ESCAPES}", UserWarning, stacklevel=1)
    assert notes == [f"transformers: value {ESCAPES}", f"transformers: UserWarning: torch says {ESCAPES}"]
    assert (logger.handlers, logger.propagate) == (handlers, propagate)
    captured = capfd.readouterr()
    assert ESCAPES not in captured.err and ESCAPES not in captured.out


def test_the_legacy_list_form_of_a_tokenizers_auto_map_is_refused_too(tmp_path, monkeypatch):
    """tokenizer_config.json's `auto_map` as [slow, fast] (transformers' old spelling)."""
    from qtool.calibration.samples import load_tokenizer

    monkeypatch.setenv("QTOOL_TEST_MARKER", str(tmp_path / "MARKER"))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    folder = copy_of(tmp_path)
    (folder / "evil.py").write_text(EVIL)
    edit_json(
        folder / "tokenizer_config.json", tokenizer_class=None, auto_map=["evil.EvilTokenizer", "evil.EvilTokenizer"]
    )
    refused(
        lambda: load_tokenizer(str(folder)),
        f"{folder}/tokenizer_config.json",
        "names its own code for its tokenizer",
        "evil.EvilTokenizer",
    )
    assert not (tmp_path / "MARKER").exists()
