"""`python -m tests.fuzz`: run the mutation fuzzer against the qtool on PYTHONPATH.

    python -m tests.fuzz --minutes 30                       # every container, round robin
    python -m tests.fuzz --cases-per-container 5000 --jobs 2
    python -m tests.fuzz --container gguf --cases-per-container 200 --seed 7
    python -m tests.fuzz --replay tests/fuzz/regressions   # the committed corpus
    python -m tests.fuzz --replay tests/fuzz/findings/pt/<case>

Exit status: 0 when every case ended as exit 0, exit 2 with one error line (or a `check` gate
exit 1), 1 when there was any finding. Findings are saved under tests/fuzz/findings/ (not
committed) with a reproducer; --summary-json writes the counts and findings as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _parse(argv: list[str]) -> argparse.Namespace:
    from tests.fuzz.seeds import CONTAINERS

    parser = argparse.ArgumentParser(
        prog="python -m tests.fuzz", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, help="stop making new cases after this long")
    parser.add_argument("--container", action="append", choices=CONTAINERS, help="only this container (repeatable)")
    parser.add_argument(
        "--cases-per-container", type=int, help="cases per container (default: until --minutes, else 200)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the campaign seed: the same seed makes the same cases")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once (forked children)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per case before it is killed")
    parser.add_argument("--memory-mib", type=int, default=1024, help="peak RSS growth per case before it is killed")
    parser.add_argument("--findings", type=Path, default=HERE / "findings", help="where findings are saved")
    parser.add_argument(
        "--replay", type=Path, nargs="+", help="run saved cases (folders with case.json) instead of fuzzing"
    )
    parser.add_argument("--summary-json", type=Path, help="write the counts and findings here")
    parser.add_argument("--quiet", action="store_true")
    return parser.parse_args(argv)


def _calibrates(roots: list[Path]) -> bool:
    """Whether a case to replay runs `--calibrate` (or `imatrix`), which imports transformers."""
    import json

    from tests.fuzz.campaign import case_folders

    for folder in case_folders(roots):
        argv = json.loads((folder / "case.json").read_text())["argv"]
        if "--calibrate" in argv:
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    log = (lambda text: None) if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    started = time.monotonic()
    from tests.fuzz.runner import Limits, preload

    preload(calibration=bool(args.replay) and _calibrates(args.replay))
    log(f"preloaded qtool and torch in {time.monotonic() - started:.1f} s")
    limits = Limits(seconds=args.timeout, memory=args.memory_mib * 2**20)
    with tempfile.TemporaryDirectory(prefix="qtool-fuzz-") as scratch:
        scratch = Path(scratch)
        if args.replay:
            return _replay(args, scratch, limits, log)
        from tests.fuzz.campaign import Campaign
        from tests.fuzz.seeds import CONTAINERS, build_seeds

        containers = tuple(args.container or CONTAINERS)
        seeds = build_seeds(scratch / "seeds", containers)
        log(f"{len(seeds)} seeds: " + ", ".join(f"{c} {sum(s.container == c for s in seeds)}" for c in containers))
        per_container = (
            args.cases_per_container if args.cases_per_container is not None else (None if args.minutes else 200)
        )
        deadline = time.monotonic() + args.minutes * 60 if args.minutes else None
        campaign = Campaign(seeds, scratch / "cases", args.findings, args.seed, limits, args.jobs, log=log)
        fuzz_started = time.monotonic()
        try:
            campaign.run(containers, per_container, deadline)
        except KeyboardInterrupt:  # a hand run stopped early still reports what it ran
            log("interrupted: the counts below cover the cases that finished")
        elapsed = time.monotonic() - fuzz_started
        summary = campaign.summary() | {"seed": args.seed, "seconds": round(elapsed, 1), "containers": list(containers)}
        _print_summary(summary)
        if args.summary_json:
            args.summary_json.write_text(json.dumps(summary, indent=2) + "\n")
        return 1 if summary["findings"] else 0


def _print_summary(summary: dict) -> None:
    from tests.fuzz.runner import ACCEPTED, FINDING_CLASSES

    classes = list(ACCEPTED) + [c for c in FINDING_CLASSES if any(c in v for v in summary["counts"].values())]
    width = max(len(c) for c in classes)
    print(f"\nqtool fuzz: seed {summary['seed']}, {summary['seconds']} s")
    print(
        f"{'container':<12} {'cases':>6} "
        + " ".join(f"{c:>{max(6, len(c))}}" for c in classes)
        + "  slowest_s  max_rss_growth_MiB"
    )
    total = 0
    for container in summary["containers"]:
        counts = summary["counts"].get(container, {})
        n = sum(counts.values())
        total += n
        print(
            f"{container:<12} {n:>6} "
            + " ".join(f"{counts.get(c, 0):>{max(6, len(c))}}" for c in classes)
            + f"  {summary['slowest_seconds'].get(container, 0):9.2f}  {summary['max_rss_growth_mib'].get(container, 0):18.1f}"
        )
    print(f"{'total':<12} {total:>6}")
    del width
    print(f"\n{len(summary['findings'])} distinct findings")
    for finding in summary["findings"]:
        outcome, exc, where = finding["signature"]
        print(f"- [{outcome}] {exc} at {where} (x{finding['count']}): {finding['first_line'][:200]}")
        print(f"    {finding['case']}")
        print(f"    {finding['reproducer']}")


def _replay(args, scratch: Path, limits, log) -> int:
    from tests.fuzz.campaign import case_folders, replay

    folders = case_folders(args.replay)
    results = replay(folders, scratch / "replay", limits, args.jobs, log)
    bad = [r for r in results if "signature" in r]
    print(f"\nreplayed {len(results)} cases: {len(results) - len(bad)} accepted, {len(bad)} findings")
    for entry in bad:
        outcome, exc, where = entry["signature"]
        print(f"- {entry['case']}: [{outcome}] {exc} at {where}\n    {entry['reproducer']}")
    if args.summary_json:
        args.summary_json.write_text(json.dumps(results, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
