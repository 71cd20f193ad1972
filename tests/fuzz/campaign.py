"""A fuzzing campaign: make cases from the seeds, run each through the forking runner, classify,
group findings by signature (outcome class + exception type + innermost qtool frame), save them
with a reproducer, and count everything per container. Also replays saved cases (the committed
regression corpus) through the same runner.

A case is a folder: `in/` (the seed's files, some mutated) and `case.json` (argv with `{in}` and
`{out}` placeholders, the mutations, and, once run, the outcome and signature).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tests.fuzz.mutators import mutate_file
from tests.fuzz.runner import ACCEPTED, Limits, Result, Runner
from tests.fuzz.seeds import CONTAINERS, Seed

__all__ = ["Campaign", "Case", "make_case", "replay", "reproducer", "signature_of"]

REPO = Path(__file__).resolve().parents[2]

# Which command runs a case, and how often. `{in}` is the target, `{out}` a fresh output path.
COMMANDS = (
    (("inspect", "{in}"), 20),
    (("inspect", "{in}", "--json"), 10),
    (("inspect", "{in}", "--raw", "-f", "tsv"), 5),
    (("inspect", "{in}", "--stats"), 20),
    (("check", "{in}"), 5),
    (("check", "{in}", "--no-nan"), 20),
    (("dequantize", "{in}", "-o", "{out}"), 20),
)


@dataclass
class Case:
    container: str
    seed: str
    target: str  # relative to in/
    argv: list[str]  # with {in} and {out}
    mutations: list[str]
    files: dict[str, bytes]  # every file of in/, mutated or not
    number: int = 0
    env: dict[str, str] = field(default_factory=dict)  # for the child (QTOOL_FUZZ_SWAP: runner._swap_during_copy)
    special: dict[str, str] = field(
        default_factory=dict
    )  # in/ paths made "fifo", or a symlink to the target given (git keeps neither FIFO nor device)

    def write(self, folder: Path, result: Result | None = None, extra: dict | None = None) -> Path:
        if folder.exists():
            shutil.rmtree(folder)
        (folder / "in").mkdir(parents=True)
        for name, data in self.files.items():
            path = folder / "in" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        for name, what in self.special.items():
            path = folder / "in" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if what == "fifo":
                os.mkfifo(path)
            else:
                os.symlink(what, path)
        document = {
            "container": self.container,
            "seed": self.seed,
            "target": self.target,
            "argv": self.argv,
            "mutations": self.mutations,
            "number": self.number,
        }
        if self.env:
            document["env"] = self.env
        if self.special:
            document["special"] = self.special
        if result is not None:
            document |= {
                "outcome": result.outcome,
                "exit_code": result.exit_code,
                "signal": result.signal,
                "seconds": round(result.seconds, 3),
                "peak_rss_growth_mib": round(result.peak_rss_growth / 2**20, 1),
                "stderr": result.stderr[-4000:],
            }
        document |= extra or {}
        (folder / "case.json").write_text(json.dumps(document, indent=2, ensure_ascii=True) + "\n")
        return folder

    @classmethod
    def read(cls, folder: Path) -> Case:
        document = json.loads((folder / "case.json").read_text())
        special = document.get("special", {})
        files = {
            name: p.read_bytes()
            for p in sorted((folder / "in").rglob("*"))
            if (name := str(p.relative_to(folder / "in"))) not in special and p.is_file()
        }
        return cls(
            document["container"],
            document["seed"],
            document["target"],
            document["argv"],
            document["mutations"],
            files,
            document.get("number", 0),
            document.get("env", {}),
            special,
        )


def _seed_files(seed: Seed) -> dict[str, bytes]:
    return {str(p.relative_to(seed.root)): p.read_bytes() for p in sorted(seed.root.rglob("*")) if p.is_file()}


def make_case(seeds: list[Seed], container: str, seed_number: int, number: int, cache: dict) -> Case:
    """The case `number` of `container` under the campaign seed `seed_number`: deterministic."""
    rng = random.Random(f"{seed_number}:{container}:{number}")
    seed = rng.choice([s for s in seeds if s.container == container])
    files = dict(cache.setdefault(seed.root, _seed_files(seed)))
    mutations = []
    for _ in range(rng.choices((1, 2, 3), (70, 20, 10))[0]):
        name = rng.choice(seed.mutable)
        if name not in files:
            continue
        files[name], what = mutate_file(rng, name, files[name])
        mutations.append(what)
    commands, weights = zip(*COMMANDS)
    argv = list(rng.choices(commands, weights)[0])
    return Case(container, seed.name, seed.target, argv, mutations, files, number)


# -- running one case ------------------------------------------------------------------------------


def _argv(case: Case, folder: Path) -> list[str]:
    target = folder / "in" / case.target
    target_text = str(target).rstrip("/.") if case.target == "." else str(target)
    return [a.replace("{in}", target_text).replace("{out}", str(folder / "out")) for a in case.argv]


_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')  # a traceback's ", in", faulthandler's " in"


def _frames(text: str) -> list[tuple[str, str]]:
    """(file, function) of every frame in a Python traceback or a faulthandler dump, outer first.
    A faulthandler dump lists innermost first: it is reversed here."""
    found = []
    faulthandler_dump = "most recent call first" in text
    for match in _FRAME.finditer(text):
        found.append((match.group(1), match.group(3)))
    if faulthandler_dump:
        first_thread = text.split("most recent call first", 1)[1].split("\n\n", 1)[0]
        found = [(m.group(1), m.group(3)) for m in _FRAME.finditer(first_thread)][::-1]
    return found


def _short_path(path: str) -> str:
    for marker in ("/qtool/", "/site-packages/", "/lib/python3"):
        if marker in path:
            return path.rsplit(marker, 1)[1] if marker != "/qtool/" else "qtool/" + path.rsplit(marker, 1)[1]
    return path


def signature_of(result: Result, debug_stderr: str | None = None) -> tuple[str, str, str]:
    """(outcome, exception type, location): how findings are grouped. The location is the
    innermost frame inside qtool (else the innermost frame), without its line number."""
    text = debug_stderr if debug_stderr else result.stderr
    exc_type = ""
    if result.outcome in ("timeout", "memory") and "MemoryError" not in text:
        exc_type = result.outcome
    elif result.signal is not None:
        import signal as _signal

        exc_type = _signal.Signals(result.signal).name
    else:
        lines = [line for line in text.splitlines() if line.strip()]
        for line in reversed(lines):
            m = re.match(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning|Fault)|[A-Z]\w+Error)\b", line)
            if m:
                exc_type = m.group(1)
                break
        if not exc_type:
            m = re.search(r"internal error: ([\w.]+)", text)
            exc_type = m.group(1) if m else f"exit {result.exit_code}"
    frames = _frames(text)
    ours = [
        f
        for f in frames
        if "/qtool/" in f[0]
        and "/tests/fuzz/" not in f[0]
        and "/qtool/cli/__init__.py" not in f[0]
        and "/qtool/cli/root.py" not in f[0]
    ]
    if ours or frames:
        where = ours[-1] if ours else frames[-1]
        return result.outcome, exc_type, f"{_short_path(where[0])}:{where[1]}"
    # no frame (an exit 2 that ran out of memory, a bare exit code): the error's words instead
    error = next((line for line in result.stderr.splitlines() if line.startswith("error:")), "")
    words = re.sub(r"/\S+", "PATH", error.removeprefix("error: "))
    words = re.sub(r"\d+", "N", words)
    return result.outcome, exc_type, f"message:{words[:70]}"


def reproducer(folder: Path, case: Case) -> str:
    relative = folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder
    argv = [
        a.replace("{in}", f"in/{case.target}".rstrip("/.")).replace("{out}", "/tmp/qtool-fuzz-out") for a in case.argv
    ]
    return f"cd {relative} && rm -rf /tmp/qtool-fuzz-out; QTOOL_DEBUG=1 qtool {' '.join(argv)}   # or: python -m tests.fuzz --replay {relative}"


# -- the campaign ----------------------------------------------------------------------------------


@dataclass
class Finding:
    signature: tuple[str, str, str]
    count: int = 0
    examples: list[Path] = field(default_factory=list)
    first_line: str = ""


@dataclass
class Campaign:
    seeds: list[Seed]
    workdir: Path
    findings_dir: Path
    seed_number: int = 0
    limits: Limits = field(default_factory=Limits)
    jobs: int = 1
    keep_examples: int = 3
    counts: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    findings: dict[tuple[str, str, str], Finding] = field(default_factory=dict)
    slowest: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    biggest: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    log: object = None

    def run(self, containers: tuple[str, ...], cases_per_container: int | None, deadline: float | None) -> None:
        runner = Runner(self.limits, self.jobs)
        cache: dict = {}
        next_number = {c: 0 for c in containers}
        pending: list[tuple[str, Case, Path, dict]] = []  # (mode, case, folder, info)
        self.workdir.mkdir(parents=True, exist_ok=True)
        order = list(containers)
        turn = 0
        try:
            while True:
                while not runner.full():
                    if pending:
                        mode, case, folder, info = pending.pop(0)
                    else:
                        if deadline is not None and time.monotonic() > deadline:
                            break
                        open_containers = [
                            c for c in order if cases_per_container is None or next_number[c] < cases_per_container
                        ]
                        if not open_containers:
                            break
                        container = open_containers[turn % len(open_containers)]
                        turn += 1
                        case = make_case(self.seeds, container, self.seed_number, next_number[container], cache)
                        next_number[container] += 1
                        folder = self.workdir / f"{container}-{case.number}"
                        case.write(folder)
                        mode, info = "normal", {}
                    env = {"QTOOL_DEBUG": "1"} if mode == "debug" else {}
                    runner.start(_argv(case, folder), folder, env, token=(mode, case, folder, info))
                if not runner.running:
                    break
                (mode, case, folder, info), result = runner.wait_one()
                if mode == "normal":
                    self._count(case, result)
                    if result.outcome not in ACCEPTED and result.outcome not in ("timeout", "memory", "signal"):
                        pending.insert(0, ("debug", case, folder, {"result": result}))
                        continue
                    if result.outcome not in ACCEPTED:
                        self._record(case, folder, result, None)
                        continue
                    shutil.rmtree(folder, ignore_errors=True)
                else:
                    self._record(case, folder, info["result"], result.stderr)
        finally:
            runner.close()

    def _count(self, case: Case, result: Result) -> None:
        self.counts[case.container][result.outcome] += 1
        total = sum(sum(c.values()) for c in self.counts.values())
        if self.log and total % 1000 == 0:
            self.log(f"{total} cases, {len(self.findings)} distinct findings so far")
        self.slowest[case.container] = max(self.slowest[case.container], result.seconds)
        self.biggest[case.container] = max(self.biggest[case.container], result.peak_rss_growth)

    def _record(self, case: Case, folder: Path, result: Result, debug_stderr: str | None) -> None:
        signature = signature_of(result, debug_stderr)
        finding = self.findings.setdefault(signature, Finding(signature))
        finding.count += 1
        if not finding.first_line:
            finding.first_line = next(
                (line for line in result.stderr.splitlines() if line.startswith("error:")),
                result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "",
            )[:300]
        if len(finding.examples) < self.keep_examples:
            slug = _slug(signature)
            dest = self.findings_dir / case.container / f"{slug}-{finding.count}"
            extra = {"signature": list(signature), "debug_stderr": (debug_stderr or "")[-6000:]}
            extra["reproducer"] = reproducer(dest, case)
            case.write(dest, result, extra)
            finding.examples.append(dest)
            if self.log:
                self.log(
                    f"finding {'|'.join(signature)} [{case.container}] {finding.first_line[:160]}\n  {extra['reproducer']}"
                )
        shutil.rmtree(folder, ignore_errors=True)

    def summary(self) -> dict:
        return {
            "counts": {c: dict(v) for c, v in self.counts.items()},
            "slowest_seconds": dict(self.slowest),
            "max_rss_growth_mib": {c: round(v / 2**20, 1) for c, v in self.biggest.items()},
            "findings": [
                {
                    "signature": list(f.signature),
                    "count": f.count,
                    "first_line": f.first_line,
                    "examples": [str(p) for p in f.examples],
                    "reproducer": reproducer(f.examples[0], Case.read(f.examples[0])) if f.examples else "",
                    "case": _describe(Case.read(f.examples[0])) if f.examples else "",
                }
                for f in sorted(self.findings.values(), key=lambda f: f.signature)
            ],
        }


def _describe(case: Case) -> str:
    return (
        f"{case.container} case {case.number} (seed file {case.seed}): qtool {' '.join(case.argv)}; "
        + "; ".join(case.mutations)[:400]
    )


def _slug(signature: tuple[str, str, str]) -> str:
    outcome, exc, where = signature
    text = f"{outcome}-{exc}-{where.rsplit('/', 1)[-1]}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:72].rstrip("_")


def replay(folders: list[Path], workdir: Path, limits: Limits | None = None, jobs: int = 1, log=None) -> list[dict]:
    """Run saved cases (case.json + in/) again; one result per case, with its signature if it is
    still a finding."""
    runner = Runner(limits or Limits(), jobs)
    results = []
    try:
        for folder in folders:
            case = Case.read(folder)
            scratch = workdir / folder.name
            case.write(scratch)
            result = runner.run(_argv(case, scratch), scratch, case.env)
            result.outcome = _expected(folder, result)
            entry = {
                "case": str(folder),
                "outcome": result.outcome,
                "exit_code": result.exit_code,
                "seconds": round(result.seconds, 3),
                "peak_rss_growth_mib": round(result.peak_rss_growth / 2**20, 1),
                "argv": case.argv,
                "container": case.container,
            }
            if result.outcome not in ACCEPTED:
                debug = None
                if result.outcome not in ("timeout", "memory", "signal"):
                    debug = runner.run(_argv(case, scratch), scratch, {**case.env, "QTOOL_DEBUG": "1"}).stderr
                entry["signature"] = list(signature_of(result, debug))
                entry["stderr"] = result.stderr[-1500:]
                entry["reproducer"] = reproducer(folder, case)
            results.append(entry)
            if log:
                log(f"{entry['outcome']:>20}  {folder}")
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        runner.close()
    return results


def _expected(folder: Path, result: Result) -> str:
    """A handmade case may say more than "accepted": `expect.outcome` (exit 0 is no success
    when the run should refuse), `expect.stderr` (the exact stderr lines, e.g. one warning
    and no numpy RuntimeWarning), `expect.max_line` (no stderr line longer: a giant name
    cut in messages) and `expect.stdout` "json" (stdout empty or one JSON document: no prompt
    before it). A miss is the outcome "unexpected"."""
    expect = json.loads((folder / "case.json").read_text()).get("expect")
    if not expect or result.outcome not in ACCEPTED:
        return result.outcome
    if "outcome" in expect and result.outcome != expect["outcome"]:
        return "unexpected"
    if "stderr" in expect and result.stderr.splitlines() != expect["stderr"]:
        return "unexpected"
    if "max_line" in expect and any(len(line) > expect["max_line"] for line in result.stderr.splitlines()):
        return "unexpected"
    if expect.get("stdout") == "json" and not _json_or_nothing(result.stdout):
        return "unexpected"
    return result.outcome


def _json_or_nothing(text: str) -> bool:
    """stdout under --json: empty (a refusal) or one JSON document, nothing before or after it."""
    if not text.strip():
        return True
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def case_folders(roots: list[Path]) -> list[Path]:
    found = []
    for root in roots:
        if (root / "case.json").is_file():
            found.append(root)
        else:
            found += sorted(p.parent for p in root.rglob("case.json"))
    return found


__all__ += ["CONTAINERS", "case_folders"]
