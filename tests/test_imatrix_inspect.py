"""`qtool inspect` of a llama.cpp importance matrix (GGUF or legacy .dat): what it covers, its
chunks and datasets, as a table and as JSON; a bad one is one line, exit 2. Through a real
subprocess, as a CI script calls it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from tests.imatrix_files import TINY_DAT, TINY_GGUF, legacy_bytes, write_imatrix_gguf


def qtool(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qtool", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize("path, counts, chunk_size", [(TINY_GGUF, [256], 64), (TINY_DAT, [4], 0)])
def test_inspect_json_says_what_an_imatrix_covers(path, counts, chunk_size):
    done = qtool("inspect", path, "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["kind"] == "imatrix" and document["format"] == path.suffix[1:]
    assert (
        document["entries"],
        document["chunk_count"],
        document["chunk_size"],
        document["datasets"],
    ) == (14, 4, chunk_size, ["topics.txt"])
    first = document["tensors"][0]
    assert first == {
        "name": "blk.0.attn_k.weight",
        "columns": 256,
        "matrices": 1,
        "counts": counts,
    }


def test_inspect_table_shows_the_summary_and_k_filters_the_rows():
    done = qtool("inspect", TINY_GGUF, "-f", "table", "--no-collapse", "-k", "re:.*ffn_down.*")
    assert done.returncode == 0, done.stderr
    assert "blk.1.ffn_down.weight" in done.stdout and "attn_q" not in done.stdout
    for fact in ("GGUF imatrix", "tensors covered", "chunk size", "topics.txt"):
        assert fact in done.stdout


def test_inspect_raw_lists_an_imatrix_ggufs_stored_tensors():
    done = qtool("inspect", TINY_GGUF, "--raw", "-f", "tsv")
    assert done.returncode == 0, done.stderr
    names = [line.split("\t")[0] for line in done.stdout.splitlines()[1:]]
    assert len(names) == 28 and "blk.0.attn_q.weight.in_sum2" in names and "blk.0.attn_q.weight.counts" in names


@pytest.mark.parametrize(
    "suffix, message",
    [
        (".gguf", "x.weight.in_sum2 holds NaN or inf"),
        (".dat", "entry x.weight appears twice"),
    ],
)
def test_a_bad_imatrix_is_one_line_exit_2(tmp_path, suffix, message):
    path = tmp_path / f"bad{suffix}"
    if suffix == ".gguf":
        write_imatrix_gguf(path, {"x.weight": (np.array([np.nan] * 32), [3])})
    else:
        path.write_bytes(legacy_bytes([(b"x.weight", 1, np.ones(4)), (b"x.weight", 1, np.ones(4))]))
    done = qtool("inspect", path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0] == f"error: {path}: {message}" and len(lines) <= 2  # the error and its hint
    assert "Traceback" not in done.stderr and done.stdout == ""
