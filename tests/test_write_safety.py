"""The write path never loses, leaks or mixes a user's files. Each test reproduces a failure
found by trying qtool as a user would, or under deliberate attack (issue "The write path,
rebuilt"), through the CLI: the path checks, side files, identity of the inputs, reports and
file modes. The writer's own guarantees (no-replace commits, --overwrite rules, staging
cleanup) are tested in test_output_safety.py."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from tests.conftest import REPO, SAMPLES

runner = CliRunner()
TINY = SAMPLES / "tiny-llama"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def digest(path: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        h.update(file.name.encode() + file.read_bytes())
    return h.hexdigest()


@pytest.fixture
def model(tmp_path) -> Path:
    """A private copy of tiny-llama (config, weights, a tokenizer) that tests may attack."""
    folder = tmp_path / "m"
    shutil.copytree(TINY, folder)
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    return folder


def one_error_line(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    first = result.stderr.splitlines()[0]
    assert first.startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in first, first
    return first


# -- paths that are, or lie inside, an input or the output ---------------------------------------


@pytest.mark.parametrize("where", ["model.safetensors", "config.json", "new-report.json"])
def test_a_report_onto_or_into_the_input_is_refused_before_anything_is_written(tmp_path, model, where):
    before = digest(model)
    result = run("quantize", model, "-o", tmp_path / "out", "--report", model / where)
    one_error_line(result, "report", "the input")
    assert digest(model) == before
    assert not (tmp_path / "out").exists()


def test_a_report_inside_the_output_is_refused(tmp_path, model):
    result = run("quantize", model, "-o", tmp_path / "out", "--report", tmp_path / "out" / "report.json")
    one_error_line(result, "inside the output")
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_an_output_onto_a_side_file_of_a_file_input_is_refused(tmp_path, model):
    config = (model / "config.json").read_bytes()
    result = run("quantize", model / "model.safetensors", "-o", model / "config.json", "--overwrite")
    one_error_line(result, "is the input")
    assert (model / "config.json").read_bytes() == config


@pytest.mark.parametrize(
    "command, source", [("quantize", "model.safetensors"), ("dequantize", "model.safetensors"), ("quantize", ".")]
)
def test_an_output_that_holds_the_input_is_refused_even_with_overwrite(tmp_path, model, command, source):
    before = digest(model)
    result = run(command, model / source, "-o", model, "--overwrite", "-q")
    one_error_line(result, "input")
    assert digest(model) == before


def test_a_config_linking_out_of_the_model_is_never_published(tmp_path, model):
    (tmp_path / "private.json").write_text('{"model_type": "llama", "secret_token": "hf_SECRET"}')
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(tmp_path / "private.json")
    one_error_line(run("quantize", model, "-o", tmp_path / "out"), "config.json", "links out of the model folder")
    assert not (tmp_path / "out").exists()
    one_error_line(
        run("dequantize", model, "-o", tmp_path / "out-folder"), "config.json", "links out of the model folder"
    )


def test_a_linked_config_does_not_stop_a_single_file_output(tmp_path, model):
    """A folder of links to shared storage: nothing is published beside one .safetensors file."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "config.json").write_bytes((model / "config.json").read_bytes())
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(shared / "config.json")
    result = subprocess.run(
        [sys.executable, "-m", "qtool", "dequantize", str(model), "-o", str(tmp_path / "back.safetensors"), "-q"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "back.safetensors").is_file() and sorted(p.name for p in tmp_path.iterdir()) == [
        "back.safetensors",
        "m",
        "shared",
    ]


def test_an_input_rewritten_in_place_with_its_mtime_restored_is_caught(tmp_path, model, monkeypatch):
    from qtool.formats.checkpoint import Checkpoint

    weights = model / "model.safetensors"
    original, calls = Checkpoint.read_bytes, []
    stamp = os.stat(weights)

    def read_then_rewrite(self, tensor, *args, **kwargs):
        data = original(self, tensor, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            with open(weights, "r+b") as handle:  # same size, same inode
                handle.seek(stamp.st_size - 64)
                handle.write(b"\x7f" * 64)
            os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        return data

    monkeypatch.setattr(Checkpoint, "read_bytes", read_then_rewrite)
    one_error_line(run("quantize", model, "-o", tmp_path / "out", "-q"), "model.safetensors", "modified")
    assert not (tmp_path / "out").exists()


def test_overwrite_never_replaces_a_folder_of_other_files(tmp_path, model):
    work = tmp_path / "work"
    (work / "code").mkdir(parents=True)
    (work / "thesis.tex").write_text("years of work")
    result = run("quantize", model, "-o", work, "--overwrite")
    one_error_line(result, "thesis.tex", "not checkpoint files")
    assert (work / "thesis.tex").read_text() == "years of work" and (work / "code").is_dir()
    done = tmp_path / "done"
    assert run("quantize", model, "-o", done, "-q").exit_code == 0
    (done / "README.md").write_text("a model card written by hand")  # qtool never writes one
    one_error_line(run("quantize", model, "-o", done, "--overwrite", "-q"), "README.md")
    assert (done / "README.md").read_text() == "a model card written by hand"


def test_missing_parents_are_created_and_a_file_in_the_way_is_named(tmp_path, model):
    assert run("quantize", model, "-o", tmp_path / "a" / "b" / "out", "-q").exit_code == 0
    assert (tmp_path / "a" / "b" / "out" / "model.safetensors").is_file()
    (tmp_path / "text.safetensors").write_text("not a folder")
    result = run("quantize", model, "-o", tmp_path / "text.safetensors" / "out")
    one_error_line(result, "is a file")


# -- running from the model's folder with bare names (the README's own example) -----------------


def _cli(*args, cwd: Path, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO), **env}
    environment.pop("QTOOL_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "qtool", *map(str, args)], cwd=cwd, capture_output=True, text=True, env=environment
    )


def test_bare_file_names_from_the_models_folder(tmp_path, model):
    (model / "notes.txt").write_text("private notes")
    done = _cli(
        "quantize",
        "model.safetensors",
        "-o",
        tmp_path / "out",
        "--scheme",
        "int8",
        "--report",
        "report.json",
        "-q",
        cwd=model,
    )
    assert done.returncode == 0, done.stderr
    # a file input carries config.json over to a folder output, and nothing else beside it
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert json.loads((model / "report.json").read_text())["summary"]["quantized_weights"] == 14
    done = _cli("dequantize", tmp_path / "out" / "model.safetensors", "-o", "single.safetensors", "-q", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "single.safetensors").is_file()


# -- side files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["/etc/passwd", "/proc/self/environ", "../outside.json"])
def test_a_side_file_linking_out_of_the_model_is_not_copied(tmp_path, model, target):
    (tmp_path / "outside.json").write_text('{"secret": 1}')
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(target)
    result = run("quantize", model, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 0, result.output
    assert "tokenizer.json is not copied" in result.stderr
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_links_inside_the_model_and_a_hugging_face_cache_repo_are_followed(tmp_path):
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name in ("model.safetensors", "config.json"):
        shutil.copy(TINY / name, repo / "blobs" / name)
        (snapshot / name).symlink_to(Path("../../blobs") / name)
    (repo / "blobs" / "tok").write_text("{}")
    (snapshot / "tokenizer.json").symlink_to("../../blobs/tok")
    (snapshot / "generation_config.json").write_text("{}")
    (snapshot / "notes.txt").write_text("not the model's")
    result = run("quantize", snapshot, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(tmp_path / "out")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert not (tmp_path / "out" / "tokenizer.json").is_symlink()


SWAP_DURING_COPY = r"""
import os, sys
import qtool.formats.writer as writer
from qtool.cli import main
model, out, outside, how = sys.argv[1:5]
write_new = writer._write_new

def swap_after_merges(path, data):
    write_new(path, data)
    if os.path.basename(path) == "merges.txt":  # vocab.json was checked; it is copied next
        victim = os.path.join(model, "vocab.json")
        os.unlink(victim)
        if how == "fifo":
            os.mkfifo(victim)
        else:
            os.symlink(outside if how == "link" else "/dev/zero", victim)

writer._write_new = swap_after_merges
sys.argv = ["qtool", "quantize", model, "-o", out, "-q"]
main()
"""


@pytest.mark.parametrize("how", ["link", "fifo", "zero"])
def test_a_side_file_swapped_during_the_copy_is_never_published_nor_waited_on(tmp_path, model, how):
    """Issue 18 #4: side files were checked, then opened again by path, following links, with
    no size cap; a swap while an earlier one is copied published a file from outside the model,
    a FIFO hung the run and /dev/zero grew memory without limit."""
    (tmp_path / "outside.txt").write_text("SECRET")
    (model / "merges.txt").write_text("#version: 0.2\n" + "a b\n" * 100_000)
    (model / "vocab.json").write_text('{"a": 0}')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [model, tmp_path / "out", tmp_path / "outside.txt", how]
    done = subprocess.run(
        [sys.executable, "-c", SWAP_DURING_COPY, *map(str, args)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {model}/vocab.json: side file changed while qtool ran"), (
        done.stderr
    )
    assert not (tmp_path / "out").exists()
    assert sorted(os.listdir(tmp_path)) == ["m", "outside.txt"]  # no staging folder left either


# -- the inputs must not change while they are read --------------------------------------------------


@pytest.mark.parametrize("how", ["replaced", "truncated"])
def test_an_input_changed_while_it_is_read_fails_and_commits_nothing(tmp_path, model, monkeypatch, how):
    from qtool.formats.checkpoint import Checkpoint

    weights = model / "model.safetensors"
    original = Checkpoint.read_bytes
    calls = []

    def read_then_change(self, tensor, *args, **kwargs):
        data = original(self, tensor, *args, **kwargs)
        calls.append(tensor.name)
        if len(calls) == 3:
            if how == "replaced":
                spare = tmp_path / "spare.safetensors"
                shutil.copy(weights, spare)
                os.replace(spare, weights)
            else:
                with open(weights, "r+b") as handle:
                    handle.truncate(os.path.getsize(weights) - 1000)
        return data

    monkeypatch.setattr(Checkpoint, "read_bytes", read_then_change)
    result = run("quantize", model, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2, result.output
    assert "model.safetensors" in result.stderr.splitlines()[0]
    assert not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if ".qtool-tmp-" in p]


# -- reports ---------------------------------------------------------------------------------------


def test_the_report_is_the_json_document_and_is_written_before_the_commit(tmp_path, model):
    result = run("quantize", model, "-o", tmp_path / "out", "--report", tmp_path / "r.json", "--json", "-q")
    assert result.exit_code == 0, result.output
    printed, written = json.loads(result.stdout), json.loads((tmp_path / "r.json").read_text())
    assert printed == written
    summary = written["summary"]
    assert summary["quantized"]["sqnr_db"] < summary["all_weights"]["sqnr_db"]  # copies count as exact
    assert summary["sqnr_db"] == summary["quantized"]["sqnr_db"]  # schema 1's field keeps its meaning


def test_a_report_that_cannot_be_written_commits_nothing(tmp_path, model, monkeypatch):
    import qtool.formats.writer as writer

    original = writer._write_new

    def full_disk(path, data):
        if "r.json" in os.path.basename(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(path, data)

    monkeypatch.setattr(writer, "_write_new", full_disk)
    result = run("quantize", model, "-o", tmp_path / "out", "--report", tmp_path / "r.json", "-q")
    one_error_line(result, "r.json", "No space left")
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_an_existing_report_needs_overwrite(tmp_path, model):
    (tmp_path / "r.json").write_text("keep")
    result = run("quantize", model, "-o", tmp_path / "out", "--report", tmp_path / "r.json", "-q")
    one_error_line(result, "r.json", "already exists")
    assert (tmp_path / "r.json").read_text() == "keep" and not (tmp_path / "out").exists()


# -- file modes follow the umask, for every layout ------------------------------------------------


@pytest.mark.parametrize("scheme, out", [("W4A16", "out"), ("q4_0", "out.gguf"), ("int8", "out.safetensors")])
def test_outputs_follow_the_umask(tmp_path, scheme, out):
    code = (
        "import os, sys; os.umask(0o027); from qtool.cli import main; "
        f"sys.argv = ['qtool', 'quantize', {str(TINY)!r}, '-o', {str(tmp_path / out)!r}, '--scheme', {scheme!r}, '-q']; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert done.returncode == 0, done.stderr
    target = tmp_path / out
    files = [target] if target.is_file() else [target, *target.iterdir()]
    for path in files:
        expected = 0o750 if path.is_dir() else 0o640
        assert path.stat().st_mode & 0o777 == expected, (path, oct(path.stat().st_mode))


# -- the library changes no process state -----------------------------------------------------------


def test_the_api_leaves_threads_and_the_environment_as_it_found_them(tmp_path):
    import torch

    from qtool import native

    torch_threads, native_threads, environ = torch.get_num_threads(), native.threads(), dict(os.environ)
    for scheme, out in (("W4A16", "a"), ("FP8", "b"), ("q8_0", "c.gguf")):
        qtool.quantize(TINY, tmp_path / out, scheme, threads=1)
    assert (torch.get_num_threads(), native.threads(), dict(os.environ)) == (torch_threads, native_threads, environ)
