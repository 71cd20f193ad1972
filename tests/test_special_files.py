"""Special files where qtool reads a file whole (issue 42 #3, #8): a FIFO in a calibration
folder, a text or an importance matrix linked to /dev/zero, a FIFO as the policy or as the
model folder's `.git/HEAD`. Each is refused (or, for the revision, left unknown) at once
through `regular_files.open_regular`: never a hang in open(), never a read of a device until
memory runs out. Hangs are tested through a real process with a timeout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, SAMPLES

TINY = SAMPLES / "tiny-llama"
TEXT = "An iterator is created for the result of the expression list. " * 40
TIMEOUT = 120  # a hang is a timeout; the refusals take seconds (the imports)


def run_qtool(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "QTOOL_DEBUG"}
    try:
        return subprocess.run(
            [sys.executable, "-m", "qtool", *map(str, args)],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"qtool {' '.join(map(str, args))} hung for {TIMEOUT} s")


def one_error(result: subprocess.CompletedProcess, *words: str) -> str:
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in errors[0], result.stderr
    return errors[0]


def _fifo(path):
    os.mkfifo(path)
    return path


def _zero(path):
    path.symlink_to("/dev/zero")
    return path


# -- calibration texts ---------------------------------------------------------------------------


@pytest.mark.parametrize("make", [_fifo, _zero], ids=["fifo", "dev-zero-link"])
def test_a_special_file_in_a_calibration_folder_is_refused_at_once(tmp_path, make):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "0.txt").write_text(TEXT)
    make(folder / "a.txt")
    out = tmp_path / "out"
    result = run_qtool(
        "quantize", TINY, "-o", out, "--calibrate", folder, "--samples", "4", "--seq-len", "32", "--threads", "1"
    )
    one_error(result, "a.txt", "not a regular file")
    assert not out.exists()


@pytest.mark.parametrize("make", [_fifo, _zero], ids=["fifo", "dev-zero-link"])
def test_the_imatrix_command_refuses_a_special_calibration_text(tmp_path, make):
    text = make(tmp_path / "a.txt")
    result = run_qtool("imatrix", TINY, "--calibrate", text, "-o", tmp_path / "i.gguf", "--chunk-size", "16")
    one_error(result, "a.txt", "not a regular file")
    assert not (tmp_path / "i.gguf").exists()


# -- importance matrices -------------------------------------------------------------------------


@pytest.mark.parametrize("name, make", [("zero.dat", _zero), ("fifo.dat", _fifo), ("fifo.gguf", _fifo)])
def test_a_special_imatrix_is_refused_at_once(tmp_path, name, make):
    path = make(tmp_path / name)
    out = tmp_path / "out.gguf"
    result = run_qtool("quantize", TINY, "-o", out, "--scheme", "Q4_K_M", "--imatrix", path)
    one_error(result, name, "not a regular file")
    assert not out.exists()


def test_dev_zero_itself_as_the_imatrix_is_refused(tmp_path):
    result = run_qtool("quantize", TINY, "-o", tmp_path / "out.gguf", "--scheme", "Q4_K_M", "--imatrix", "/dev/zero")
    one_error(result, "/dev/zero", "not a regular file")


# -- the policy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [_fifo, _zero], ids=["fifo", "dev-zero-link"])
def test_a_special_policy_file_is_refused_at_once(tmp_path, make):
    policy = make(tmp_path / "policy.toml")
    result = run_qtool("check", SAMPLES / "tiny-llama-w4a16", "--policy", policy)
    one_error(result, "policy.toml", "not a regular file")


# -- the revision of a model in a git work tree (#8) ---------------------------------------------


def _model_in_git(tmp_path, head: str | None):
    work = tmp_path / "work"
    shutil.copytree(TINY, work / "model")
    (work / ".git" / "refs" / "heads").mkdir(parents=True)
    if head is None:
        os.mkfifo(work / ".git" / "HEAD")
    else:
        (work / ".git" / "HEAD").write_text(head)
    return work / "model"


@pytest.mark.parametrize("flags", [("--json",), ("--report", "r.json")], ids=["json", "report"])
def test_a_fifo_as_git_head_leaves_the_revision_unknown_and_does_not_hang(tmp_path, flags):
    model = _model_in_git(tmp_path, None)
    out = tmp_path / "out"
    flags = tuple(str(tmp_path / f) if f.endswith(".json") else f for f in flags)
    result = run_qtool("quantize", model, "-o", out, "--scheme", "W8A16", *flags)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout if "--json" in flags else (tmp_path / "r.json").read_text())
    assert document["models"]["input"]["revision"] is None


def test_the_revision_is_read_before_the_output_is_committed(tmp_path, monkeypatch):
    import qtool
    from qtool.formats import revision

    commit = "0123456789abcdef0123456789abcdef01234567"
    model = _model_in_git(tmp_path, "ref: refs/heads/main\n")
    (model.parent / ".git" / "refs" / "heads" / "main").write_text(commit + "\n")
    out = tmp_path / "out"
    seen = []
    real = revision._read

    def spy(path, limit):
        seen.append(os.path.exists(out))
        return real(path, limit)

    monkeypatch.setattr(revision, "_read", spy)
    document = qtool.quantize(model, out, "W8A16").to_json()  # no report: the document is made after the run
    assert document["models"]["input"]["revision"] == {
        "source": "git",
        "repo": None,
        "commit": commit,
        "ref": "refs/heads/main",
    }
    assert seen and not any(seen), "the revision was read after the output was committed"


@pytest.mark.parametrize("fifo", ["packed-refs", "commondir"])
def test_a_fifo_among_the_ref_files_leaves_the_revision_unknown(tmp_path, fifo):
    model = _model_in_git(tmp_path, "ref: refs/heads/main\n")  # no loose ref: the lookup goes on to packed-refs
    os.mkfifo(model.parent / ".git" / fifo)
    (model.parent / ".git" / "refs" / "heads" / "x").symlink_to("/dev/zero")
    code = f"from qtool.formats.revision import revision_of as r; print(r({str(model)!r}))"
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the revision lookup hung on a FIFO as .git/{fifo}")
    assert result.returncode == 0 and result.stdout == "None\n", result.stderr


# -- checkpoint files named directly ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt", "model.bpk", "model.gguf"])
def test_a_fifo_named_as_the_checkpoint_is_refused_at_once(tmp_path, name):
    path = _fifo(tmp_path / name)
    one_error(run_qtool("inspect", path), name, "not a regular file")
