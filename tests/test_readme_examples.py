"""Every `qtool ...` command line in README.md's code blocks, run in a real shell.

Each runs in a fresh folder where the README's placeholder paths exist: `model/` is a copy of
sample_models/tiny-llama, `model-w4/` what the README's own `qtool quantize model/ -o model-w4/`
writes, `qtool-policy.toml` the README's own policy, and so on (PLACEHOLDERS). A command's exit
status must be 0, or the one its comment states (`# exit 1: ...`). Pipes to jq run through jq
when it is installed, else through a JSON parse. `--device cuda` lines are skipped without CUDA,
and also run with `--device cpu`, so a CPU-only machine still checks the rest of the line.

A README line that fails is a failing test. Known bugs are xfail(strict=True), so they flip to
XPASS, and fail, when fixed: then take them off KNOWN_FAILURES.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, SAMPLES

README = REPO / "README.md"
TINY = SAMPLES / "tiny-llama"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)
SHELL_BLOCKS = ("", "sh", "bash", "console", "yaml")

# README line (verbatim) -> why it fails today
KNOWN_FAILURES: dict[str, str] = {}


@dataclass(frozen=True)
class Example:
    line: str  # as the README has it
    command: str  # without the trailing comment
    exit_code: int  # 0, or what the comment says
    section: str

    @property
    def id(self) -> str:
        return self.command


def _strip_comment(line: str) -> tuple[str, str]:
    """Split `cmd args  # comment` at the first # that starts a shell comment (outside quotes,
    after a blank)."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip(), line[index + 1 :].strip()
    return line.rstrip(), ""


def readme_examples(text: str) -> list[Example]:
    examples = []
    for match in FENCE.finditer(text):
        language, body = match.group(1).strip(), match.group(2)
        if language not in SHELL_BLOCKS:
            continue
        headings = re.findall(r"^#+ (.*)$", text[: match.start()], re.M)
        section = headings[-1] if headings else ""
        for raw in body.splitlines():
            line = raw.strip()
            if language == "yaml":
                step = re.match(r"-\s*run:\s*(.*)", line)
                if not step:
                    continue
                line = step.group(1)
            for part in line.split(" && "):
                part = part.strip()
                if not part.startswith("qtool "):
                    continue
                command, comment = _strip_comment(part)
                code = re.match(r"exit (\d+)", comment)
                examples.append(Example(part, command, int(code.group(1)) if code else 0, section))
    return examples


EXAMPLES = readme_examples(README.read_text(encoding="utf-8"))


def _policy_toml(text: str) -> str:
    """The qtool-policy.toml the CI example puts beside the model: the toml block after 'with
    this `qtool-policy.toml` beside it'."""
    at = text.index("with this `qtool-policy.toml` beside it")
    return next(m.group(2) for m in FENCE.finditer(text, at) if m.group(1).strip() == "toml")


# -- placeholders ----------------------------------------------------------------------------------


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    (shutil.copytree if source.is_dir() else shutil.copy2)(source, target)


def _f16_gguf(target: Path) -> None:
    """A small LLaMA-shaped F16 GGUF with random weights, made with gguf-py as llama.cpp's
    converter would lay it out (tests/fixtures/gguf_mix/make_reference.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_reference", Path(__file__).parent / "fixtures" / "gguf_mix" / "make_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target.parent.mkdir(parents=True, exist_ok=True)
    module.write_model(str(target), dict(layers=2, hidden=256, heads=4, kv=4, ffn=512, tied=False, dtype="F16"), seed=0)


def _prose() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))[:20000]


def _renamed(source: Path, target: Path, old: str, new: str) -> None:
    """A copy of a one-file safetensors folder with `old` replaced by `new` in tensor names: the
    header is rewritten, the data bytes are the same."""
    _copy(source, target)
    data = (source / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    header = {name.replace(old, new): entry for name, entry in header.items()}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (target / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size :])


def _env(bin_dir: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QTOOL_", "_QTOOL"))}
    env["HOME"] = str(home)  # `qtool --install-completion` writes to ~/.bashrc: a scratch one
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env["COLUMNS"] = "120"
    return env


def _shim(bin_dir: Path) -> None:
    """`qtool` on PATH: this interpreter and this checkout, whether or not pip installed it."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "qtool"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m qtool "$@"\n')
    shim.chmod(0o755)


def _bash(script: str, cwd: Path, bin_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=_env(bin_dir, cwd), capture_output=True, text=True, timeout=600
    )


class Placeholders:
    """Each placeholder made once, in a store, by copying a sample or running the README's own
    command that writes it; then copied into each example's folder."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.bin = store.parent / "bin"
        _shim(self.bin)
        text = README.read_text(encoding="utf-8")
        self.makers = {
            "model": lambda: _copy(TINY, store / "model"),
            "model.safetensors": lambda: _copy(TINY / "model.safetensors", store / "model.safetensors"),
            "sample_models/tiny-llama": lambda: _copy(TINY, store / "sample_models" / "tiny-llama"),
            "qtool-policy.toml": lambda: (store / "qtool-policy.toml").write_text(_policy_toml(text)),
            # written by the README's own commands (the CI workflow's, the quantize section's)
            "model-w4": lambda: self._qtool("quantize model/ -o model-w4/ --scheme W4A16 -q", "model"),
            "model-w4-asym": lambda: self._qtool("quantize model/ -o model-w4-asym/ --scheme W4A16_ASYM -q", "model"),
            "tiny-w4": lambda: self._qtool(
                "quantize sample_models/tiny-llama -o tiny-w4 --scheme W4A16", "sample_models/tiny-llama"
            ),
            # the layouts other examples read
            "model-fp8": lambda: self._qtool("quantize model/ -o model-fp8/ --scheme FP8 -q", "model"),
            "model.gguf": lambda: self._qtool("quantize model/ -o model.gguf --scheme q4_0 -q", "model"),
            "model-q4_0.gguf": lambda: self._qtool("quantize model/ -o model-q4_0.gguf --scheme q4_0 -q", "model"),
            "model-f16.gguf": lambda: _f16_gguf(store / "model-f16.gguf"),
            # the calibration section's AWQ line, quiet: the CI section gates its output
            "model-awq": lambda: self._qtool(
                "quantize model/ -o model-awq/ --scheme int4:g64 --calibrate calibration.txt --samples 8 --seq-len 128 --algorithm awq -q",
                "model",
                "calibration.txt",
            ),
            "imatrix.gguf": lambda: self._qtool(
                "imatrix model/ --calibrate calibration.txt -o imatrix.gguf --chunks 16 --chunk-size 128 -q",
                "model",
                "calibration.txt",
            ),
            # `--calibrate calibration.txt`: English prose, CPython's language reference topics
            "calibration.txt": lambda: (
                store.mkdir(parents=True, exist_ok=True),
                (store / "calibration.txt").write_text(_prose()),
            ),
            # `compare a/ b/ --map 're:^transformer\.h\.=model.layers.'`: GPT-2 style names in A
            "a": lambda: _renamed(TINY, store / "a", "model.layers.", "transformer.h."),
            "b": lambda: self._qtool("quantize model/ -o b/ --scheme W8A16 -q", "model"),
        }

    def _qtool(self, args: str, *needs: str) -> None:
        for name in needs:
            self.get(name)
        result = _bash(f"qtool {args}", self.store, self.bin)
        assert result.returncode == 0, f"making a placeholder: qtool {args}\n{result.stderr}"

    def get(self, name: str) -> Path:
        path = self.store / name
        if not path.exists():
            self.makers[name]()
        return path

    def provide(self, names: set[str], folder: Path) -> None:
        for name in sorted(names):
            _copy(self.get(name), folder / name)


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory) -> Placeholders:
    return Placeholders(tmp_path_factory.mktemp("readme") / "store")


def _written(words: list[str]) -> set[str]:
    """What a command writes: `-o X`, `--report X`, `> X`."""
    out = set()
    for flag, value in zip(words, words[1:]):
        if flag in ("-o", "--output", "--report", "--html", ">"):
            out.add(value.rstrip("/"))
    return out


def _read(command: str, makers) -> set[str]:
    words = shlex.split(command.replace(">", " > "))
    written = _written(words)
    return {w.rstrip("/") for w in words if w.rstrip("/") in makers and w.rstrip("/") not in written}


# -- the tests -------------------------------------------------------------------------------------


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Remote locations need a network the tests don't have; tests/test_remote.py runs the same
# commands against a loopback server instead.
REMOTE = re.compile(r"\b(hf|https?)://")


def _cases():
    for example in EXAMPLES:
        marks = []
        if REMOTE.search(example.command):
            marks.append(
                pytest.mark.skip(
                    reason="a remote location: no network in tests (tests/test_remote.py covers it on loopback)"
                )
            )
        if example.line in KNOWN_FAILURES:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[example.line]))
        if "--device cuda" in example.command:
            cuda_marks = marks + [
                pytest.mark.skipif(not _cuda(), reason="needs CUDA (torch.cuda.is_available() is False)")
            ]
            yield pytest.param(example, "cuda", marks=cuda_marks, id=example.id)
            yield pytest.param(
                example, "cpu", marks=marks, id=example.id.replace("--device cuda", "--device cpu") + " [cpu twin]"
            )
        else:
            yield pytest.param(example, None, marks=marks, id=example.id)


def test_the_readme_has_the_examples_we_expect():
    """A guard on the extraction: code blocks of each kind, comments and exit codes parsed."""
    lines = [e.line for e in EXAMPLES]
    assert len(EXAMPLES) >= 20
    assert "qtool inspect sample_models/tiny-llama" in lines  # after `pip install -e . &&`
    assert "qtool quantize model/ -o model-w4/ --scheme W4A16 -q" in lines  # a workflow `- run:`
    codes = {e.command: e.exit_code for e in EXAMPLES}
    assert codes["qtool check model-w4/ --expect-scheme W5A16"] == 2
    assert codes["qtool check model-w4/ --expect-scheme W8A16"] == 1
    assert codes["qtool inspect model/ --raw -f tsv"] == 0
    assert set(KNOWN_FAILURES) <= set(lines), "a KNOWN_FAILURES line is no longer in the README"


@pytest.mark.skipif(shutil.which("bash") is None, reason="runs the README's lines in bash")
@pytest.mark.parametrize(("example", "device"), list(_cases()))
def test_readme_example(example: Example, device: str | None, placeholders: Placeholders, tmp_path):
    command = example.command if device != "cpu" else example.command.replace("--device cuda", "--device cpu")
    placeholders.provide(_read(command, placeholders.makers), tmp_path)
    script = command
    if "| jq" in script and shutil.which("jq") is None:
        script = re.sub(r"\|\s*jq\b.*$", "| python -c 'import json, sys; json.load(sys.stdin)'", script)
    result = _bash(f"set -o pipefail\n{script}", tmp_path, placeholders.bin)
    shown = f"{example.section}: {example.line}\nexit {result.returncode}\n--- stderr\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, shown
    assert result.returncode == example.exit_code, shown
    if "--json" in command and "|" not in command and ">" not in command:
        json.loads(result.stdout)


def test_the_reference_policy_file_is_valid(tmp_path):
    """The `qtool-policy.toml` section shows every key: the file must load, with valid rules."""
    from qtool.policy import load_policy

    text = README.read_text(encoding="utf-8")
    section = text[text.index("### `qtool-policy.toml`") :]
    policy = tmp_path / "qtool-policy.toml"
    policy.write_text(next(m.group(2) for m in FENCE.finditer(section) if m.group(1).strip() == "toml"))
    load_policy(policy).check.validate()


def test_the_python_api_example_runs_as_written(tmp_path):
    """The README's Python block, word for word, from a folder holding `sample_models/`."""
    block = next(m.group(2) for m in FENCE.finditer(README.read_text()) if m.group(1).strip() == "python")
    (tmp_path / "sample_models").symlink_to(SAMPLES)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env["TMPDIR"] = str(scratch)
    done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "sample_models",
        "scratch",
    ]  # nothing left in the current folder
    (out,) = scratch.iterdir()
    assert (out / "tiny-w4" / "model.safetensors").is_file() and (out / "tiny-back.safetensors").is_file()
    # the dequantize result prints as one short line, not its whole plan (40 KB)
    line = done.stdout.strip()
    assert "\n" not in line and len(line) < 300 and line.startswith("<RunReport ") and "14 dequantized" in line
