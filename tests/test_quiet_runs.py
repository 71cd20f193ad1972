"""A routine run says what matters once (issue 42 item 24): llama.cpp's row fallbacks are one
line per kind (Q4_K -> Q5_0), each tensor listed in the plan's notes (`--dry-run --json`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, SAMPLES


def _smollm2_gguf():
    sys.path.insert(0, str(SAMPLES))
    try:
        from real_models import Unavailable, smollm2_gguf
    finally:
        sys.path.remove(str(SAMPLES))
    try:
        return smollm2_gguf()
    except Unavailable as exc:
        pytest.skip(str(exc))


def _qtool(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qtool", *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=600
    )


def test_smollm2_q4_k_m_says_each_fallback_kind_once(tmp_path):
    source = _smollm2_gguf()
    done = _qtool("quantize", source, "-o", tmp_path / "out.gguf", "--scheme", "Q4_K_M", "--allow-requantize", "-q")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "warning: requantizing 211 already-quantized weights: they are dequantized first, and errors compound",
        "warning: 166 tensors fall back from Q4_K to Q5_0: their rows of 576 values are not a multiple of Q4_K's block (256); each is listed in --dry-run --json's notes",
        "warning: 14 tensors fall back from Q6_K to Q8_0: their rows of 576 values are not a multiple of Q6_K's block (256); each is listed in --dry-run --json's notes",
    ]
    plan = _qtool(
        "quantize",
        source,
        "-o",
        tmp_path / "out2.gguf",
        "--scheme",
        "Q4_K_M",
        "--allow-requantize",
        "--dry-run",
        "--json",
    )
    assert plan.returncode == 0, plan.stderr
    notes = json.loads(plan.stdout)["notes"]
    assert (
        len([n for n in notes if n.endswith("Q5_0 instead")]) == 166
        and len([n for n in notes if n.endswith("Q8_0 instead")]) == 14
    )
    assert "blk.0.attn_q.weight: rows of 576 values are not a multiple of the Q4_K block (256): Q5_0 instead" in notes
