"""`qtool imatrix MODEL --calibrate TEXT -o imatrix.gguf` (qtool/calibration/imatrix.py): the
importance matrix llama-imatrix computes, checked against the one the real llama-imatrix wrote
on the same model and text (tests/fixtures/imatrix); llama-quantize --imatrix takes qtool's
file; `quantize --calibrate` to GGUF computes and uses it in one command."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from qtool import api
from qtool.formats.imatrix import read_imatrix
from qtool.plan import QUANTIZE
from tests.conftest import REPO, SAMPLES
from tests.imatrix_files import FIXTURES, TINY_GGUF

pytest.importorskip("transformers")

TINY = SAMPLES / "tiny-llama"
LLAMA_QUANTIZE = os.environ.get("LLAMA_QUANTIZE", "/work/llama/build/bin/llama-quantize")


def _make_fixtures():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE = _make_fixtures()


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """The text llama-imatrix read for the fixture: the first 60000 bytes of pydoc's topics."""
    path = tmp_path_factory.mktemp("text") / "topics.txt"
    path.write_bytes(MAKE.topics_text())
    return path


@pytest.fixture(scope="module")
def computed(text, tmp_path_factory):
    out = tmp_path_factory.mktemp("imatrix") / "tiny-imatrix.gguf"
    document = api.imatrix(TINY, out, text, chunks=MAKE.CHUNKS, chunk_size=MAKE.CTX)
    return out, document


def test_qtools_imatrix_is_llama_imatrixs_on_the_same_model_and_text(computed, text):
    """Same entries, names, token counts and chunks. The first layer's attention inputs (the
    normed embeddings) agree to float rounding, which proves the same tokens, chunks and BOS;
    deeper ones within 2%, as llama.cpp's BF16 matmuls round the activations they multiply."""
    out, document = computed
    ours, theirs = read_imatrix(out), read_imatrix(TINY_GGUF)
    assert list(ours.entries) == list(theirs.entries)
    assert (ours.chunk_count, ours.chunk_size, ours.datasets) == (
        theirs.chunk_count,
        theirs.chunk_size,
        (str(text).encode(),),
    )
    for name, entry in theirs.entries.items():
        mine = ours.entries[name]
        assert mine.counts == entry.counts and mine.columns == entry.columns, name
        tolerance = 1e-5 if name.startswith("blk.0.attn_") and name != "blk.0.attn_output.weight" else 2e-2
        np.testing.assert_allclose(mine.sums, entry.sums, rtol=tolerance, err_msg=name)
    assert document["kind"] == "imatrix" and document["entries"] == 14 and len(document["layers"]) == 2


@pytest.mark.skipif(not os.path.exists(LLAMA_QUANTIZE), reason="llama-quantize not built (set LLAMA_QUANTIZE)")
def test_llama_quantize_takes_qtools_imatrix(computed, tmp_path):
    out, _ = computed
    model = tmp_path / "tiny.gguf"
    api.quantize(TINY, model, "Q8_0", ignore=["re:.*"])
    done = subprocess.run(
        [LLAMA_QUANTIZE, "--imatrix", str(out), str(model), str(tmp_path / "q.gguf"), "Q4_K_M", "1"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"loaded 14 importance matrix entries from {out} computed on 4 chunks" in done.stdout
    assert "did not find weights for blk." not in done.stdout + done.stderr


def test_quantize_calibrate_to_gguf_computes_and_uses_the_imatrix(computed, text, tmp_path):
    out, _ = computed
    target = tmp_path / "q4_k_m.gguf"
    plan = api.prepare_quantize(TINY, target, "Q4_K_M", calibrate=text, samples=MAKE.CHUNKS, seq_len=MAKE.CTX)
    assert plan.calibration.to_json() == {"text": str(text), "algorithm": "imatrix", "chunks": 4, "chunk_size": 64}
    assert plan.calibration.mix == "Q4_K_M"  # the mix's rules weigh the computed matrix, as they weigh a file
    report = api.run(plan)
    importance = read_imatrix(out)
    for job in report.plan.jobs:  # the plan written: the plan made, with the matrix's rows beside it
        name = job.outputs[0].name
        if job.action == QUANTIZE and name in importance.entries:
            np.testing.assert_array_equal(job.encoding.importance, importance.entries[name].importance(), err_msg=name)
    assert all(
        job.encoding is None or job.encoding.importance is None for job in plan.jobs
    )  # the plan made is not changed
    fields = gguf.GGUFReader(str(target)).fields
    assert bytes(fields["quantize.imatrix.dataset"].parts[-1]) == str(text).encode()
    assert (
        fields["quantize.imatrix.entries_count"].contents() == 14
        and fields["quantize.imatrix.chunks_count"].contents() == 4
    )
    assert report.calibration["entries"] == 14 and report.to_json()["calibration"]["entries"] == 14


def qtool(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qtool", *map(str, args)], cwd=REPO, capture_output=True, text=True, check=False
    )


def test_bad_requests_are_one_line_exit_2(text, tmp_path):
    done = qtool("imatrix", TINY, "--calibrate", text, "-o", tmp_path / "imatrix.dat")
    assert (
        done.returncode == 2
        and "an importance matrix is written as GGUF and its name should end in .gguf" in done.stderr
    )
    done = qtool("imatrix", TINY, "--calibrate", tmp_path / "missing.txt", "-o", tmp_path / "imatrix.gguf")
    assert done.returncode == 2 and "no such calibration text" in done.stderr
    tiny_text = tmp_path / "short.txt"
    tiny_text.write_text("a few words")
    done = qtool("imatrix", TINY, "--calibrate", tiny_text, "-o", tmp_path / "imatrix.gguf", "--chunk-size", "64")
    assert done.returncode == 2 and "fewer than one chunk of 64" in done.stderr
    assert not (tmp_path / "imatrix.gguf").exists() and "Traceback" not in done.stderr


def test_the_cli_says_how_many_chunks_before_it_starts(text, tmp_path):
    """issue 42 item 24: `qtool imatrix` said nothing of the work ahead (the README's example ran
    376 s on the sample model, its first output at 198 s). Now its first line says how many
    chunks of how many tokens over how many layers, before the first layer runs; -q says nothing."""
    done = qtool(
        "imatrix",
        TINY,
        "--calibrate",
        text,
        "-o",
        tmp_path / "imatrix.gguf",
        "--chunks",
        "3",
        "--chunk-size",
        "64",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == "imatrix: 3 chunks of 64 tokens, through 2 decoder layers", lines
    assert lines[1].startswith("layer 1/2: ")
    quiet = qtool(
        "imatrix",
        TINY,
        "--calibrate",
        text,
        "-o",
        tmp_path / "quiet.gguf",
        "--chunks",
        "3",
        "--chunk-size",
        "64",
        "-q",
        "--json",
    )
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
