"""Turn saved findings into the committed regression corpus: one case per distinct signature
(outcome + exception type + innermost qtool frame), the smallest example, with the area of the
code that owns the fix.

    python -m tests.fuzz.promote tests/fuzz/findings            # copy into tests/fuzz/regressions
    python -m tests.fuzz.promote tests/fuzz/findings --list     # print the table only
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from tests.fuzz.campaign import Case, _slug, case_folders, reproducer, signature_of
from tests.fuzz.runner import Result

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# Where a fix belongs, by the innermost qtool frame (first match wins)
AREAS = (
    ("qtool/formats/torch_pickle.py", "torchpt"),
    ("qtool/conventions/torch_native.py", "torchpt"),
    ("qtool/formats/gguf.py", "readers"),
    ("qtool/conventions/gguf.py", "readers"),
    ("qtool/formats/safetensors.py", "readers"),
    ("qtool/formats/checkpoint.py", "readers"),
    ("qtool/stats.py", "readers"),
    ("qtool/audit.py", "readers"),
    ("qtool/kernels/gguf", "readers"),
    ("qtool/formats/loader.py", "untrusted-json"),
    ("qtool/formats/writer.py:side_file", "untrusted-json"),  # a side file's text written back
    ("qtool/formats/writer.py", "readers"),  # an output sized from a shape the reader let through
    ("qtool/side_files.py", "untrusted-json"),
    ("qtool/conventions/", "untrusted-json"),
    ("qtool/formats/burnpack.py", "unowned (burnpack reader; nearest: readers)"),
    ("qtool/native", "unowned (C extension)"),
)


def area_of(signature: list[str], container: str = "") -> str:
    _outcome, exc, where = signature
    if exc == "SIGBUS":
        return "readers"
    for prefix, area in AREAS:
        if where.startswith(prefix):
            return area
    if container in ("pt", "pt_legacy"):  # no qtool frame: torch.load's own failure
        return "torchpt"
    return "unassigned"


def _signature(document: dict) -> tuple[str, ...]:
    """The signature again, from the saved output (so a better frame parser regroups old finds)."""
    if not document.get("signature"):
        return ()
    outcome = document.get("outcome", "")
    result = Result(
        document["argv"],
        document.get("exit_code"),
        document.get("signal"),
        document.get("seconds", 0.0),
        0,
        "",
        document.get("stderr", ""),
        killed_for=outcome if outcome in ("timeout", "memory") else None,
        outcome=outcome,
    )
    return tuple(signature_of(result, document.get("debug_stderr") or None))


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in (folder / "in").rglob("*") if p.is_file())


def pick(findings: Path) -> dict[tuple[str, ...], Path]:
    """The smallest saved example of each signature."""
    best: dict[tuple[str, ...], Path] = {}
    for folder in case_folders([findings]):
        document = json.loads((folder / "case.json").read_text())
        signature = _signature(document)
        if not signature:
            continue
        if signature not in best or _size(folder) < _size(best[signature]):
            best[signature] = folder
    return best


def promote(findings: Path, regressions: Path) -> list[dict]:
    rows = []
    for signature, folder in sorted(pick(findings).items()):
        case = Case.read(folder)
        document = json.loads((folder / "case.json").read_text())
        dest = regressions / case.container / _slug(signature)  # type: ignore[arg-type]
        if dest.exists():
            shutil.rmtree(dest)
        case.write(
            dest,
            extra={
                "signature": list(signature),
                "area": area_of(list(signature), case.container),
                "first_seen": {
                    k: document.get(k) for k in ("outcome", "exit_code", "signal", "seconds", "peak_rss_growth_mib")
                },
                "stderr": document.get("stderr", "")[-1500:],
                "reproducer": reproducer(dest, case),
            },
        )
        rows.append(
            {
                "signature": list(signature),
                "area": area_of(list(signature), case.container),
                "case": str(dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest),
                "argv": case.argv,
                "mutations": case.mutations,
                "stderr": document.get("stderr", ""),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fuzz.promote", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("findings", type=Path)
    parser.add_argument("--regressions", type=Path, default=HERE / "regressions")
    parser.add_argument("--list", action="store_true", help="print what would be promoted")
    parser.add_argument("--markdown", action="store_true", help="print the promoted cases as FINDINGS.md sections")
    args = parser.parse_args(argv)
    if args.list:
        for signature, folder in sorted(pick(args.findings).items()):
            print(f"{area_of(list(signature), folder.parent.name):<45} {' | '.join(signature)}  {folder}")
        return 0
    rows = promote(args.findings, args.regressions)
    for row in rows:
        if args.markdown:
            error = next(
                (line for line in row["stderr"].splitlines() if line.startswith("error:")), row["stderr"].strip()[-200:]
            )
            print(f"### [{row['area']}] {row['signature'][1]} at `{row['signature'][2]}` ({row['signature'][0]})\n")
            print(f"- case: `{row['case']}`: `qtool {' '.join(row['argv'])}` after {'; '.join(row['mutations'])[:300]}")
            print(f"- prints: `{error[:300]}`\n")
        else:
            print(f"{row['area']:<45} {' | '.join(row['signature'])}  {row['case']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
