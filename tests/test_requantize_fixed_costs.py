"""The fixed costs of a GGUF requantize (issue 42 #15: SmolLM2's Q4_1 to Q8_0 within 1/1.5 of
llama-quantize's time, where the model is small enough that qtool's start dominates): a plain
run imports no calibration module, and walks the vocabulary's strings in C."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, SAMPLES

# the CLI in this process, then what it imported and how the header's strings were walked
_RUN = r"""
import sys
from qtool.formats import gguf
walks = []
import qtool.api
walk = gguf._prefixed_walk
gguf.use_prefixed_walk(lambda *args: walks.append(args[1:]) or walk(*args))
from qtool.cli import main
sys.argv = ["qtool", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
loaded = sorted(name for name in sys.modules if name.startswith("qtool.calibration."))
assert loaded == ["qtool.calibration.algorithms"], loaded
assert walks, "the header's string arrays were walked in Python"
"""


def test_a_gguf_requantize_loads_no_calibration_stage_and_walks_strings_in_c(tmp_path):
    q4_1 = tmp_path / "q4_1.gguf"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "qtool",
            "quantize",
            str(SAMPLES / "tiny-llama"),
            "-o",
            str(q4_1),
            "--scheme",
            "q4_1",
            "-q",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert made.returncode == 0, made.stderr
    argv = ["quantize", str(q4_1), "-o", str(tmp_path / "q8_0.gguf"), "--scheme", "Q8_0", "--allow-requantize", "-q"]
    done = subprocess.run([sys.executable, "-c", _RUN, *argv], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
