"""The fuzzer in CI: the committed regression corpus replays to exit 0 or exit 2 with one line,
a short fixed-seed campaign over every container finds nothing, and the harness itself can see
each kind of failure (a test that cannot fail is worse than none).

Each run is one `python -m tests.fuzz` subprocess: it imports qtool and torch once and forks a
child per case. Budget: 7 x 30 cases plus the corpus: about 30 s on 2 busy cores.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fuzz.campaign import Case, case_folders, make_case
from tests.fuzz.mutators import mutate_file, safetensors_json_edit, truncate
from tests.fuzz.seeds import CONTAINERS, build_seeds, safetensors_bytes
from tests.fuzz.structure import parse

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
REGRESSIONS = HERE / "regressions"
CI_SEED = 0
CI_CASES_PER_CONTAINER = 30


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("QTOOL_DEBUG", None)
    return env


def _fuzz(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.fuzz", "--quiet", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# -- the regression corpus -------------------------------------------------------------------------

_CORPUS = case_folders([REGRESSIONS]) if REGRESSIONS.is_dir() else []


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> dict[str, dict]:
    """Every regression case run once through the fuzzer's runner (one subprocess)."""
    out = tmp_path_factory.mktemp("replay") / "replay.json"
    done = _fuzz("--replay", str(REGRESSIONS), "--summary-json", str(out))
    assert out.is_file(), done.stderr[-3000:]
    return {entry["case"]: entry for entry in json.loads(out.read_text())}


@pytest.mark.parametrize("case", _CORPUS, ids=[str(p.relative_to(REGRESSIONS)) for p in _CORPUS])
def test_regression_case_is_exit_0_or_one_line_exit_2(replayed, case: Path):
    entry = replayed[str(case)]
    if "signature" not in entry:
        return
    recorded = json.loads((case / "case.json").read_text())
    outcome, exc, where = entry["signature"]
    pytest.fail(
        textwrap.dedent(
            f"""\
            {case.relative_to(REPO)} still fails: [{outcome}] {exc} at {where}
              area: {recorded.get("area", "?")}; first found as: {" | ".join(recorded.get("signature", []))}
              command: qtool {" ".join(recorded["argv"])}   (mutations: {"; ".join(recorded["mutations"])[:300]})
              stderr: {entry.get("stderr", "").strip()[-600:]}
              reproduce: {entry["reproducer"]}"""
        ),
        pytrace=False,
    )


def test_the_corpus_covers_every_container_it_names():
    containers = {json.loads((c / "case.json").read_text())["container"] for c in _CORPUS}
    assert containers <= set(CONTAINERS)
    for case in _CORPUS:
        assert (case / "in").is_dir() and any((case / "in").iterdir()), case


# -- a short campaign ------------------------------------------------------------------------------


def test_a_fixed_seed_campaign_finds_nothing(tmp_path):
    summary_path = tmp_path / "summary.json"
    done = _fuzz(
        "--seed",
        str(CI_SEED),
        "--cases-per-container",
        str(CI_CASES_PER_CONTAINER),
        "--findings",
        str(tmp_path / "findings"),
        "--summary-json",
        str(summary_path),
    )
    assert summary_path.is_file(), done.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    counts = summary["counts"]
    assert sum(sum(c.values()) for c in counts.values()) == CI_CASES_PER_CONTAINER * len(CONTAINERS), counts
    if summary["findings"]:
        again = f"python -m tests.fuzz --seed {CI_SEED} --cases-per-container {CI_CASES_PER_CONTAINER} [--container X]"
        lines = [
            f"{len(summary['findings'])} distinct findings in {summary['seconds']} s; the same cases again: {again}"
        ]
        for finding in summary["findings"]:
            outcome, exc, where = finding["signature"]
            lines.append(f"- [{outcome}] {exc} at {where} (x{finding['count']}): {finding['first_line'][:200]}")
            lines.append(f"    {finding['case']}")
            lines.append(f"    {finding['reproducer']}")
        pytest.fail("\n".join(lines), pytrace=False)


# -- the harness can fail ----------------------------------------------------------------------------

_SELFTEST = r"""
import json, sys, tempfile
from pathlib import Path
import qtool.cli
from tests.fuzz.runner import Limits, Runner

def fake_main():  # stands in for qtool's main in the forked child
    mode = sys.argv[1]
    if mode == "hang":
        while True:
            pass
    if mode == "eat":
        blocks = []
        while True:
            blocks.append(bytearray(32 << 20))
            blocks[-1][::4096] = b"\x01" * len(blocks[-1][::4096])
    if mode == "segv":
        import ctypes
        ctypes.string_at(0)
    if mode == "bug":
        sys.stderr.write("error: internal error: KeyError: 'x' (this is a bug in qtool)\n")
        sys.exit(70)
    if mode == "two-lines":
        sys.stderr.write("error: bad file\nsomething else\n")
        sys.exit(2)
    if mode == "one-line":
        sys.stderr.write("error: bad file\nhint: do this\n")
        sys.exit(2)
    if mode == "traceback":
        sys.stderr.write("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nValueError: x\n")
        sys.exit(2)
    if mode == "exit1":
        sys.stderr.write("error: bad\n")
        sys.exit(1)
    sys.exit(0)

qtool.cli.main = fake_main
runner = Runner(Limits(seconds=1.5, memory=200 << 20))
folder = Path(tempfile.mkdtemp())
print(json.dumps({m: runner.run([m], folder).outcome for m in sys.argv[1:]}))
"""


def test_the_runner_sees_every_kind_of_failure():
    modes = ["ok", "one-line", "two-lines", "traceback", "bug", "exit1", "hang", "eat", "segv"]
    done = subprocess.run(
        [sys.executable, "-c", _SELFTEST, *modes],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcomes == {
        "ok": "exit0",
        "one-line": "exit2-one-line",
        "two-lines": "exit2-not-one-line",
        "traceback": "traceback",
        "bug": "internal-error",
        "exit1": "exit1",
        "hang": "timeout",
        "eat": "memory",
        "segv": "signal",
    }


# -- mutators and seeds ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return build_seeds(tmp_path_factory.mktemp("fuzz") / "seeds")


def test_cases_are_a_function_of_the_seed(seeds):
    for container in ("safetensors", "gguf"):
        first = [make_case(seeds, container, 3, n, {}) for n in range(20)]
        again = [make_case(seeds, container, 3, n, {}) for n in range(20)]
        other = [make_case(seeds, container, 4, n, {}) for n in range(20)]
        assert [(c.files, c.argv) for c in first] == [(c.files, c.argv) for c in again]
        assert [c.files for c in first] != [c.files for c in other]


def test_every_container_has_seeds(seeds):
    assert {s.container for s in seeds} == set(CONTAINERS)
    for seed in seeds:
        assert (seed.root / seed.target).exists(), seed
        assert all((seed.root / name).is_file() for name in seed.mutable), seed


def test_safetensors_structure_and_truncation_at_every_boundary():
    data = safetensors_bytes({"a": ("F32", [2], bytes(8)), "b": ("F16", [4], bytes(8))}, {"format": "pt"})
    s = parse("model.safetensors", data)
    header_end = 8 + int.from_bytes(data[:8], "little")
    assert s.fields[0].offset == 0 and s.fields[0].fmt == "<Q"
    assert {0, 8, header_end, header_end + 8, len(data)} <= s.boundaries
    cuts = set()
    for n in range(200):
        buffer = bytearray(data)
        truncate(random.Random(n), buffer, s)
        cuts.add(len(buffer))
    assert {8, header_end, header_end + 8} <= cuts


def test_header_edits_keep_the_length_field_true_and_reach_tensor_entries():
    data = safetensors_bytes({"a": ("F32", [2, 2], bytes(16))})
    edits = set()
    for n in range(300):
        buffer = bytearray(data)
        what = safetensors_json_edit(random.Random(n), buffer, parse("m.safetensors", data))
        edits.add(what.split(":")[1].split("=")[0].split()[0] if ":" in what else what)
        if "length kept" not in what:
            assert 8 + int.from_bytes(buffer[:8], "little") <= len(buffer)
    assert {"dtype", "shape", "data_offsets"} <= edits


def test_mutations_of_every_seed_file_are_bytes(seeds):
    for seed in seeds:
        for name in seed.mutable:
            data = (seed.root / name).read_bytes()
            for n in range(5):
                mutated, what = mutate_file(random.Random(n), name, data)
                assert isinstance(mutated, bytes) and what.startswith(name)


def test_a_saved_case_reads_back(tmp_path):
    case = Case(
        "gguf", "mixed", "model.gguf", ["inspect", "{in}"], ["x"], {"model.gguf": b"GGUF", "sub/config.json": b"{}"}, 7
    )
    case.write(tmp_path / "c")
    assert Case.read(tmp_path / "c") == case
