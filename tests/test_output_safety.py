"""Output safety: generic laid-out files, no-replace commits, --overwrite of checkpoints only,
parent folders, the umask, staging names and the cleanup of dead runs, interrupts, input
identity, and atomic reports."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.errors import EXIT_USAGE, CheckpointError, UsageError
from qtool.formats import staging
from qtool.formats.writer import (
    LaidOutFile,
    Output,
    OutTensor,
    ShardWriter,
    abort_all,
    cleanup_stale,
    safetensors_layout,
    write_json_atomic,
)
from tests.conftest import REPO, SAMPLES

TINY = SAMPLES / "tiny-llama"
U8_4 = [OutTensor("a", "U8", (4,))]


def python(code: str, *args, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def finished(process: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


@pytest.fixture
def no_renameat2(monkeypatch):
    """A kernel or filesystem without renameat2: the fallbacks run."""
    monkeypatch.setattr(staging, "_renameat2", None)


def small_output(target, *, single_file=False, overwrite=False, data=b"new!") -> Output:
    out = Output(str(target), single_file=single_file, overwrite=overwrite)
    out.shard("model.safetensors", U8_4, None).write("a", data)
    return out


def read_a(path) -> bytes:
    with safe_open(str(path), "np") as handle:
        return handle.get_tensor("a").tobytes()


# -- 1. one writer for any fixed layout --------------------------------------------------------


def test_laid_out_file_writes_a_gguf_like_layout_at_absolute_offsets(tmp_path):
    header = b"GGUF" + bytes(12)  # 16 bytes, then data aligned to 32 with zero padding between
    ranges = {"blk.0": (32, 40), "blk.1": (64, 67)}
    path = tmp_path / "x.gguf"
    writer = LaidOutFile(str(path), header, ranges, 96)
    writer.write("blk.1", b"xyz")
    writer.write("blk.0", b"5678", at=4)  # pieces in any order
    writer.write("blk.0", b"1234")
    writer.finish()
    raw = path.read_bytes()
    assert len(raw) == 96 and raw[:16] == header
    assert raw[32:40] == b"12345678" and raw[64:67] == b"xyz"
    assert raw[16:32] == bytes(16) and raw[40:64] == bytes(24) and raw[67:] == bytes(29)


def test_laid_out_file_refuses_bad_layouts_overruns_and_short_tensors(tmp_path):
    with pytest.raises(ValueError, match="overlaps"):
        LaidOutFile(str(tmp_path / "o"), b"h" * 8, {"a": (8, 16), "b": (12, 20)}, 32)
    with pytest.raises(ValueError, match="overlaps the header"):
        LaidOutFile(str(tmp_path / "o"), b"h" * 8, {"a": (4, 16)}, 32)
    with pytest.raises(ValueError, match="outside"):
        LaidOutFile(str(tmp_path / "o"), b"h" * 8, {"a": (8, 40)}, 32)
    assert os.listdir(tmp_path) == []  # refused before the file was created
    writer = LaidOutFile(str(tmp_path / "o"), b"h" * 8, {"a": (8, 12)}, 12)
    with pytest.raises(RuntimeError, match="overruns"):
        writer.write("a", b"12345")
    writer.write("a", b"12")
    with pytest.raises(RuntimeError, match="got 2 of its 4 bytes"):
        writer.finish()


def test_safetensors_layout_is_what_shard_writer_writes(tmp_path):
    tensors = [OutTensor("w", "F32", (2, 3)), OutTensor("s", "U8", (5,))]
    header, ranges, size = safetensors_layout(tensors, {"k": "v"})
    assert (
        ranges == {"w": (len(header), len(header) + 24), "s": (len(header) + 24, len(header) + 29)}
        and size == len(header) + 29
    )
    for cls, args in ((ShardWriter, (tensors, {"k": "v"})), (LaidOutFile, (header, ranges, size))):
        writer = cls(str(tmp_path / f"{cls.__name__}.safetensors"), *args)
        writer.write("w", bytes(range(24)))
        writer.write("s", b"abcde")
        writer.finish()
    assert (tmp_path / "ShardWriter.safetensors").read_bytes() == (tmp_path / "LaidOutFile.safetensors").read_bytes()
    assert qtool.open_checkpoint(tmp_path / "ShardWriter.safetensors").tensors["s"].shape == (5,)


def test_output_file_commits_a_single_gguf(tmp_path):
    out = Output(str(tmp_path / "m.gguf"), single_file=True, overwrite=False)
    out.file("model.gguf", b"GGUF", {"t": (32, 36)}, 64).write("t", b"data")
    out.commit()
    assert os.listdir(tmp_path) == ["m.gguf"]
    assert (tmp_path / "m.gguf").read_bytes()[32:36] == b"data"


# -- 2. the commit never replaces what appeared meanwhile --------------------------------------


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "fallback"])
@pytest.mark.parametrize("single_file", [False, True], ids=["folder", "file"])
def test_commit_never_replaces_what_appeared_meanwhile(tmp_path, monkeypatch, fallback, single_file):
    if fallback:
        monkeypatch.setattr(staging, "_renameat2", None)
    target = tmp_path / ("out.safetensors" if single_file else "out")
    out = small_output(target, single_file=single_file)
    (target.mkdir() if not single_file else None)
    (target / "mine.txt" if not single_file else target).write_text("theirs")
    with pytest.raises(UsageError) as caught:
        out.commit()
    assert str(caught.value) == f"output {target} appeared while writing; nothing was replaced"
    assert caught.value.exit_code == EXIT_USAGE
    assert os.listdir(tmp_path) == [target.name]  # the staging is gone
    assert (target / "mine.txt" if not single_file else target).read_text() == "theirs"


def test_the_folder_fallback_does_not_replace_an_empty_folder_that_appeared(tmp_path, no_renameat2):
    out = small_output(tmp_path / "out")
    (tmp_path / "out").mkdir()
    with pytest.raises(UsageError, match="appeared while writing"):
        out.commit()
    assert os.listdir(tmp_path / "out") == []


RACER = r"""
import os, sys, time
from qtool.errors import QtoolError
from qtool.formats import staging
from qtool.formats.writer import Output, OutTensor
target, sync, me, single, fallback = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5] == "1"
if fallback:
    staging._renameat2 = None
try:
    out = Output(target, single_file=single, overwrite=False)
    out.shard("model.safetensors", [OutTensor("a", "U8", (4,))], None).write("a", me.encode())
    open(os.path.join(sync, me), "w").close()
    deadline = time.time() + 30
    while len(os.listdir(sync)) < 2 and time.time() < deadline:  # both staged before either commits
        time.sleep(0.001)
    out.commit()
except QtoolError as exc:
    print(exc, file=sys.stderr)
    sys.exit(exc.exit_code)
"""


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "fallback"])
@pytest.mark.parametrize("single_file", [False, True], ids=["folder", "file"])
def test_two_processes_racing_to_one_output_exactly_one_wins(tmp_path, single_file, fallback):
    parent, sync = tmp_path / "models", tmp_path / "sync"
    sync.mkdir()
    target = parent / ("out.safetensors" if single_file else "out")
    racers = [python(RACER, target, sync, name, int(single_file), int(fallback)) for name in ("AAAA", "BBBB")]
    results = [finished(racer) for racer in racers]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, EXIT_USAGE], results
    loser = next(err for code, _, err in results if code)
    assert loser.strip() == f"output {target} appeared while writing; nothing was replaced"
    assert os.listdir(parent) == [target.name]  # the loser's staging is gone
    winner = "AAAA" if results[0][0] == 0 else "BBBB"
    assert read_a(target if single_file else target / "model.safetensors") == winner.encode()


@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "aside"])
@pytest.mark.parametrize("single_file", [False, True], ids=["folder", "file"])
def test_overwrite_replaces_a_previous_checkpoint(tmp_path, monkeypatch, fallback, single_file):
    if fallback:
        monkeypatch.setattr(staging, "_renameat2", None)
    target = tmp_path / ("out.safetensors" if single_file else "out")
    small_output(target, single_file=single_file, data=b"old!").commit()
    small_output(target, single_file=single_file, overwrite=True, data=b"new!").commit()
    assert read_a(target if single_file else target / "model.safetensors") == b"new!"
    assert os.listdir(tmp_path) == [target.name]


@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "aside"])
def test_overwrite_never_replaces_what_changed_meanwhile(tmp_path, monkeypatch, fallback):
    if fallback:
        monkeypatch.setattr(staging, "_renameat2", None)
    target = tmp_path / "out"
    small_output(target, data=b"old!").commit()
    out = small_output(target, overwrite=True)
    (target / "thesis.tex").write_text("years of work")  # the old output is no longer only a checkpoint
    with pytest.raises(UsageError, match=f"^output {target} changed while writing; nothing was replaced$"):
        out.commit()
    assert (target / "thesis.tex").read_text() == "years of work" and read_a(target / "model.safetensors") == b"old!"
    assert os.listdir(tmp_path) == ["out"]
    # replaced by another folder altogether (another inode)
    (target / "thesis.tex").unlink()
    out = small_output(target, overwrite=True)
    os.rename(target, tmp_path / "moved")
    (target).mkdir()
    (target / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="changed while writing"):
        out.commit()
    assert os.listdir(target) == ["config.json"]


def test_overwrite_puts_the_old_output_back_when_the_final_rename_fails(tmp_path, monkeypatch, no_renameat2):
    target = tmp_path / "out"
    small_output(target, data=b"old!").commit()
    out = small_output(target, overwrite=True)
    real = staging.rename_noreplace

    def failing(source, destination):
        if source == out.staging:
            raise OSError(errno.EIO, "Input/output error")
        return real(source, destination)

    monkeypatch.setattr(staging, "rename_noreplace", failing)
    with pytest.raises(CheckpointError, match="Input/output error"):
        out.commit()
    assert read_a(target / "model.safetensors") == b"old!"
    assert os.listdir(tmp_path) == ["out"]


def test_cleanup_puts_back_an_old_output_whose_run_died_between_the_renames(tmp_path):
    target = tmp_path / "out"
    small_output(target, data=b"old!").commit()
    dead = dead_pid()
    aside = tmp_path / f".out{staging.OLD_MARK}{dead}-1-{staging._HOST}-00000000"
    os.rename(target, aside)
    assert cleanup_stale(str(tmp_path)) == []
    assert os.listdir(tmp_path) == ["out"] and read_a(target / "model.safetensors") == b"old!"


# -- 3. --overwrite replaces only a checkpoint ---------------------------------------------------


def test_overwrite_refuses_a_folder_of_other_files(tmp_path):
    target = tmp_path / "work"
    (target / "code").mkdir(parents=True)
    for name in ("thesis.tex", "model.safetensors", "config.json"):
        (target / name).write_text("x")
    with pytest.raises(UsageError) as caught:
        Output(str(target), single_file=False, overwrite=True)
    assert (
        str(caught.value)
        == f"output {target} holds code/, thesis.tex, which are not checkpoint files; refusing to replace it"
    )
    assert sorted(os.listdir(tmp_path)) == ["work"]  # nothing was written
    for index in range(6):
        (target / f"notes{index}.txt").write_text("x")
    with pytest.raises(
        UsageError, match=r"holds code/, notes0.txt, notes1.txt, notes2.txt, notes3.txt and 3 more, which"
    ):
        Output(str(target), single_file=False, overwrite=True)


def test_overwrite_accepts_a_hugging_face_model_folder(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    names = [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "chat_template.jinja",
    ]  # a model card, licence or code may be hand-written: refused (test_write_safety)
    for name in names:
        (target / name).write_text("x")
    small_output(target, overwrite=True).commit()
    assert os.listdir(target) == ["model.safetensors"]


@pytest.mark.parametrize(
    "make, single_file, message",
    [
        (lambda p: p.mkdir(), True, "is a folder, and this output is one file; refusing to replace it"),
        (lambda p: p.write_text("x"), False, "is a file, and this output is a folder; refusing to replace it"),
        (lambda p: os.symlink(p.parent, p), False, "is a symlink; refusing to replace it"),
    ],
    ids=["folder-for-a-file", "file-for-a-folder", "symlink"],
)
def test_overwrite_refuses_the_wrong_kind_of_target(tmp_path, make, single_file, message):
    target = tmp_path / ("out.safetensors" if single_file else "out")
    make(target)
    with pytest.raises(UsageError, match=f"^output {target} {message}$"):
        Output(str(target), single_file=single_file, overwrite=True)


def test_overwrite_refuses_a_file_that_is_not_a_checkpoint(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("x")
    with pytest.raises(UsageError, match=r"is not a checkpoint file \(.safetensors, .gguf\); refusing"):
        Output(str(target), single_file=True, overwrite=True)


def test_the_cli_refuses_to_overwrite_a_folder_of_other_files(tmp_path):
    (tmp_path / "thesis.tex").write_text("x")
    result = CliRunner().invoke(app, ["quantize", str(TINY), "-o", str(tmp_path), "--overwrite", "-q"])
    assert result.exit_code == EXIT_USAGE
    assert (
        result.stderr.splitlines()[0]
        == f"error: output {tmp_path} holds thesis.tex, which are not checkpoint files; refusing to replace it"
    )
    assert os.listdir(tmp_path) == ["thesis.tex"]


# -- 4. parent folders ---------------------------------------------------------------------------


def test_missing_parent_folders_are_created_and_removed_again_on_abort(tmp_path):
    target = tmp_path / "a" / "b" / "out"
    out = small_output(target)
    out.abort()
    assert os.listdir(tmp_path) == []
    small_output(target).commit()
    assert os.listdir(tmp_path / "a" / "b") == ["out"]


def test_a_file_in_the_way_of_the_output_folder_is_named(tmp_path):
    (tmp_path / "a").write_text("x")
    with pytest.raises(UsageError) as caught:
        Output(str(tmp_path / "a" / "b" / "out"), single_file=False, overwrite=False)
    assert str(caught.value) == f"cannot create output {tmp_path}/a/b/out: {tmp_path}/a is a file"
    assert caught.value.exit_code == EXIT_USAGE
    result = CliRunner().invoke(app, ["quantize", str(TINY), "-o", str(tmp_path / "a" / "out"), "-q"])
    assert (
        result.exit_code == EXIT_USAGE
        and f"{tmp_path}/a is a file" in result.stderr
        and "does not exist" not in result.stderr
    )


# -- 5. the umask --------------------------------------------------------------------------------

UMASK = r"""
import json, os, sys
os.umask(int(sys.argv[2], 8))
from qtool.formats.writer import Output, OutTensor, write_json_atomic
base = sys.argv[1]
source = os.path.join(base, "tokenizer.json")
with open(source, "w") as handle:
    handle.write("{}")
out = Output(os.path.join(base, "new", "out"), single_file=False, overwrite=False)
out.shard("model.safetensors", [OutTensor("a", "U8", (1,))], None).write("a", b"x")
out.side_file("config.json", {})
out.carry_side_file("tokenizer.json", open(source, "rb").read())
out.commit()
one = Output(os.path.join(base, "one.safetensors"), single_file=True, overwrite=False)
one.shard("model.safetensors", [OutTensor("a", "U8", (1,))], None).write("a", b"x")
one.commit()
write_json_atomic(os.path.join(base, "report.json"), {"ok": True})
os.remove(source)
modes = {}
for root, dirs, files in os.walk(base):
    for name in dirs + files:
        path = os.path.join(root, name)
        modes[os.path.relpath(path, base)] = os.stat(path).st_mode & 0o777
print(json.dumps(modes))
"""


@pytest.mark.parametrize("umask", ["022", "077", "002"])
def test_outputs_follow_the_umask(tmp_path, umask):
    code, out, err = finished(python(UMASK, tmp_path, umask))
    assert code == 0, err
    mask = int(umask, 8)
    folder, file = 0o777 & ~mask, 0o666 & ~mask
    assert json.loads(out) == {
        "new": folder,
        "new/out": folder,
        "new/out/model.safetensors": file,
        "new/out/config.json": file,
        "new/out/tokenizer.json": file,
        "one.safetensors": file,
        "report.json": file,
    }


# -- 6. staging names, and the cleanup of dead runs ----------------------------------------------


def own_start() -> int:
    with open("/proc/self/stat", "rb") as handle:
        raw = handle.read()
    return int(raw[raw.rindex(b")") + 2 :].split()[19])


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_staging_names_carry_the_owner(tmp_path):
    out = Output(str(tmp_path / "out"), single_file=False, overwrite=False)
    name = os.path.basename(out.staging)
    assert re.fullmatch(rf"\.out\.qtool-tmp-{os.getpid()}-{own_start()}-[0-9a-f]{{8}}-[0-9a-f]{{8}}", name), name
    out.abort()
    long = "x" * 250 + ".safetensors"
    assert len(os.path.basename(staging.staging_path(str(tmp_path / long)))) == 255


def test_cleanup_removes_only_entries_of_dead_runs(tmp_path):
    host, start, dead = staging._HOST, own_start(), dead_pid()
    entries = {
        f".a{staging.TMP_MARK}{dead}-{start}-{host}-00000000": False,  # dead pid
        f".b{staging.TMP_MARK}{os.getpid()}-{start + 1}-{host}-00000000": False,  # pid reused: another start
        f".c{staging.TMP_MARK}{os.getpid()}-{start}-{host}-00000000": True,  # ours, alive
        f".d{staging.TMP_MARK}{dead}-{start}-0badc0de-00000000": True,  # another host: can't tell
        ".e.qtool-tmp-k2j4_x9q": True,  # an older qtool's name: no owner in it
        "thesis.tex": True,
    }
    for index, name in enumerate(entries):
        (tmp_path / name).mkdir() if index % 2 else (tmp_path / name).write_text("x")
    removed = cleanup_stale(str(tmp_path))
    assert sorted(removed) == sorted(str(tmp_path / n) for n, keep in entries.items() if not keep)
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, keep in entries.items() if keep)


KILLED = r"""
import os, signal, sys
from qtool.formats.writer import Output, OutTensor
out = Output(sys.argv[1], single_file=False, overwrite=False)
out.shard("model.safetensors", [OutTensor("a", "U8", (4,))], None).write("a", b"1234")
os.kill(os.getpid(), signal.SIGKILL)
"""

WAITING = r"""
import os, sys, time
from qtool.formats.writer import Output, OutTensor
out = Output(sys.argv[1], single_file=False, overwrite=False)
print(out.staging, flush=True)
sys.stdin.read()
out.abort()
"""


def test_the_next_run_removes_a_killed_runs_staging_but_never_a_live_ones(tmp_path):
    code, _, _ = finished(python(KILLED, tmp_path / "out"))
    assert code == -signal.SIGKILL
    (leftover,) = os.listdir(tmp_path)
    assert leftover.startswith(".out.qtool-tmp-")
    live = python(WAITING, tmp_path / "other", stdin=subprocess.PIPE)
    live_staging = live.stdout.readline().strip()
    try:
        out = Output(str(tmp_path / "out"), single_file=False, overwrite=False)
        assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(out.staging), os.path.basename(live_staging)])
        out.abort()
    finally:
        live.stdin.close()
        assert live.wait(timeout=60) == 0
    assert os.listdir(tmp_path) == []


# -- 7. interrupts -------------------------------------------------------------------------------


def test_abort_all_removes_every_live_staging(tmp_path):
    first = small_output(tmp_path / "one")
    second = small_output(tmp_path / "two.safetensors", single_file=True)
    assert len(os.listdir(tmp_path)) == 2
    abort_all()
    assert os.listdir(tmp_path) == []
    first.abort(), second.abort()  # still safe afterwards


def test_an_interrupt_right_after_the_staging_is_created_leaks_nothing(tmp_path, monkeypatch):
    real = os.mkdir

    def interrupted(path, mode=0o777):
        real(path, mode)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "mkdir", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Output(str(tmp_path / "out"), single_file=False, overwrite=False)
    monkeypatch.setattr(os, "mkdir", real)
    assert len(os.listdir(tmp_path)) == 1
    abort_all()  # what atexit does
    assert os.listdir(tmp_path) == []


EXITING = r"""
import os, signal, sys, time
from qtool.formats.writer import Output, OutTensor, abort_all
how = sys.argv[2]
signal.signal(signal.SIGTERM, lambda *_: (abort_all(), os._exit(143)))
out = Output(sys.argv[1], single_file=False, overwrite=False)
out.shard("model.safetensors", [OutTensor("a", "U8", (4,))], None).write("a", b"12")
if how == "exception":
    raise RuntimeError("a bug, uncaught")
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["exception", "sigterm"])
def test_a_dying_process_removes_its_staging(tmp_path, how):
    process = python(EXITING, tmp_path / "out", how)
    if how == "sigterm":
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGTERM)
    code, _, err = finished(process)
    assert code == (143 if how == "sigterm" else 1), err
    assert os.listdir(tmp_path) == []


# -- 8. input identity ---------------------------------------------------------------------------


def two_tensors(path, a=b"aaaa", b=b"bbbb"):
    writer = ShardWriter(str(path), [OutTensor("a", "U8", (4,)), OutTensor("b", "U8", (4,))])
    writer.write("a", a)
    writer.write("b", b)
    writer.finish()
    return path


def test_a_file_replaced_between_reads_is_caught(tmp_path):
    path = two_tensors(tmp_path / "m.safetensors")
    checkpoint = qtool.open_checkpoint(path)
    assert bytes(checkpoint.read_bytes(checkpoint.tensors["a"])) == b"aaaa"
    checkpoint.verify_unchanged()
    os.replace(two_tensors(tmp_path / "new.safetensors", b"AAAA", b"BBBB"), path)
    assert bytes(checkpoint.read_bytes(checkpoint.tensors["b"])) == b"bbbb"  # still the file that was parsed
    with pytest.raises(CheckpointError) as caught:
        checkpoint.verify_unchanged()
    assert str(caught.value) == f"{path}: changed while it was read (replaced by another file); nothing was written"
    checkpoint.close()


def test_a_file_replaced_before_its_first_read_is_caught(tmp_path):
    path = two_tensors(tmp_path / "m.safetensors")
    checkpoint = qtool.open_checkpoint(path)
    os.replace(two_tensors(tmp_path / "new.safetensors", b"AAAA", b"BBBB"), path)
    with pytest.raises(CheckpointError, match="replaced by another file"):
        checkpoint.read_small(checkpoint.tensors["a"])
    with pytest.raises(CheckpointError, match="replaced by another file"):
        checkpoint.load(checkpoint.tensors["a"])


def test_a_file_truncated_or_modified_under_us_is_caught(tmp_path):
    path = two_tensors(tmp_path / "m.safetensors")
    size = os.path.getsize(path)
    checkpoint = qtool.open_checkpoint(path)
    checkpoint.read_bytes(checkpoint.tensors["a"])
    checkpoint.load(checkpoint.tensors["a"])
    os.truncate(path, size - 2)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: tensor 'b' is cut short"):
        checkpoint.read_bytes(checkpoint.tensors["b"])
    with pytest.raises(CheckpointError, match="cut short"):
        checkpoint.read_small(checkpoint.tensors["b"])
    with pytest.raises(CheckpointError, match="cut short"):
        checkpoint.load(checkpoint.tensors["b"])  # not a SIGBUS
    with pytest.raises(CheckpointError, match=rf"truncated from {size} to {size - 2} bytes\); nothing was written"):
        checkpoint.verify_unchanged()
    checkpoint.close()

    path = two_tensors(tmp_path / "n.safetensors")
    checkpoint = qtool.open_checkpoint(path)
    checkpoint.read_bytes(checkpoint.tensors["a"])
    with open(path, "r+b") as handle:  # same size, new bytes
        handle.seek(-4, os.SEEK_END)
        handle.write(b"XXXX")
    os.utime(path, ns=(time.time_ns(), os.stat(path).st_mtime_ns + 1_000_000))
    with pytest.raises(CheckpointError, match=r"changed while it was read \(modified\)"):
        checkpoint.verify_unchanged()


def test_each_file_is_opened_once_and_closed_with_the_checkpoint(tmp_path):
    path = two_tensors(tmp_path / "m.safetensors")
    before = len(os.listdir("/proc/self/fd"))
    checkpoint = qtool.open_checkpoint(path)
    for _ in range(3):
        for tensor in checkpoint:
            checkpoint.read_bytes(tensor)
            checkpoint.read_small(tensor)
    assert len(checkpoint._fds) == 1 and len(os.listdir("/proc/self/fd")) == before + 1
    checkpoint.close()
    assert len(os.listdir("/proc/self/fd")) == before


# -- 9. reports ----------------------------------------------------------------------------------


def test_write_json_atomic_refuses_what_exists_unless_told(tmp_path):
    path = tmp_path / "reports" / "r.json"
    write_json_atomic(str(path), {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(UsageError, match=f"^report {path} already exists$"):
        write_json_atomic(str(path), {"a": 2})
    write_json_atomic(str(path), {"a": 2}, overwrite=True)
    assert json.loads(path.read_text()) == {"a": 2}
    with pytest.raises(UsageError, match="is not a regular file; refusing to replace it"):
        write_json_atomic(str(tmp_path / "reports"), {}, overwrite=True)
    assert os.listdir(tmp_path / "reports") == ["r.json"]
    os.mkfifo(tmp_path / "fifo.json")
    os.symlink(path, tmp_path / "link.json")
    for special in ("fifo.json", "link.json"):  # never replaced, even with overwrite
        with pytest.raises(UsageError, match="is not a regular file"):
            write_json_atomic(str(tmp_path / special), {}, overwrite=True)
    assert os.path.islink(tmp_path / "link.json") and stat.S_ISFIFO(os.lstat(tmp_path / "fifo.json").st_mode)


def test_write_json_atomic_never_replaces_a_report_that_appeared(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    real = os.fsync

    def racing(fd):
        real(fd)
        path.write_text("theirs")

    monkeypatch.setattr(os, "fsync", racing)
    with pytest.raises(UsageError, match="appeared while writing; nothing was replaced"):
        write_json_atomic(str(path), {"a": 1})
    assert os.listdir(tmp_path) == ["r.json"] and path.read_text() == "theirs"


def test_a_full_disk_leaves_no_report_behind(tmp_path, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(CheckpointError, match=r"r.json: cannot write: No space left on device"):
        write_json_atomic(str(tmp_path / "new" / "r.json"), {"a": 1})
    assert os.listdir(tmp_path) == []


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 64 KiB tmpfs, where this test may mount one (root with CAP_SYS_ADMIN)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, check=False
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_real_full_disk_leaves_nothing(tiny_disk):
    with pytest.raises(CheckpointError, match="No space left on device"):
        write_json_atomic(str(tiny_disk / "r.json"), {"blob": "x" * 200_000})
    out = Output(str(tiny_disk / "out"), single_file=False, overwrite=False)
    with pytest.raises(CheckpointError, match="No space left on device"):
        out.shard("model.safetensors", [OutTensor("a", "U8", (1 << 20,))], None)
    out.abort()
    assert os.listdir(tiny_disk) == []


def test_the_host_tag_of_staging_names_is_unchanged_without_the_socket_module():
    """Staging names carry a tag of the host and pid namespace, which a later run matches to
    clean up stale ones: read by uname now (issue 18 #14, the socket module cost ~10 ms of every
    start), it must be the tag gethostname() made."""
    import hashlib
    import socket

    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    assert staging._host_tag() == hashlib.sha1(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]
