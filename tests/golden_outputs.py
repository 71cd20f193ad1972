"""Golden outputs of the write side: for every layout × every scheme and mix it stores, on the
sample models, GGUF models made by gguf-py, and one real weight set (all-MiniLM-L6-v2), the
sha256 of every file written and the run's report document (less its timing).

Why: a redesign of the write side (issue 17) must keep every byte qtool writes. A golden is
updated only on purpose, with the reason in the commit message:

    python -m tests.golden_outputs --update            # rewrite tests/fixtures/golden/outputs.json
    python -m tests.golden_outputs --update -k W4A16   # only the cases whose id contains W4A16

The same holds for what `inspect --json` says of every checkpoint file the repo ships.
`tests/test_golden_outputs.py` replays each case and compares.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_models"
GOLDEN = REPO / "tests" / "fixtures" / "golden" / "outputs.json"


@dataclass(frozen=True)
class Case:
    """One run: `command` is "quantize" or "dequantize", `source` a key of SOURCES, `output` the
    output's name (a folder, or a file ending in .safetensors or .gguf)."""

    source: str
    command: str
    output: str
    scheme: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        parts = [self.source, self.command, self.scheme or "", self.output]
        parts += [f"{key}={value}" for key, value in sorted(self.options.items())]
        return "/".join(p for p in parts if p)


def _mix_reference():
    spec = importlib.util.spec_from_file_location(
        "make_reference", REPO / "tests" / "fixtures" / "gguf_mix" / "make_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gguf_model(name: str) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        reference = _mix_reference()
        path = folder / f"{name}.gguf"
        if not path.exists():
            reference.write_model(str(path), reference.MODELS[name], seed=7)
        return path

    return make


def _minilm(folder: Path) -> Path:
    sys.path.insert(0, str(SAMPLES))
    try:
        from real_models import Unavailable, minilm
    finally:
        sys.path.remove(str(SAMPLES))
    try:
        return minilm()
    except Unavailable as exc:
        import pytest

        pytest.skip(str(exc))


SOURCES: dict[str, Callable[[Path], Path]] = {
    "tiny": lambda _: SAMPLES / "tiny-llama",
    "sharded": lambda _: SAMPLES / "tiny-llama-sharded",
    "w4a16": lambda _: SAMPLES / "tiny-llama-w4a16",
    "w8a16": lambda _: SAMPLES / "tiny-llama-w8a16",
    "fp8": lambda _: SAMPLES / "tiny-llama-fp8",
    "tiny2_f32": _gguf_model("tiny2_f32"),
    "gqa8_320": _gguf_model("gqa8_320"),
    "odd4_272": _gguf_model("odd4_272"),
    "moe8": _gguf_model("moe8"),
    "minilm": _minilm,
}

CT_SCHEMES = [
    "W8A16", "W4A16", "W4A16_ASYM", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16",
    "int8", "int8:tensor", "int8:g128:asym", "int4:g64:asym", "int4:channel", "int3:g64", "int2:g64", "int2:g64:asym",
    "fp8_e4m3:channel", "fp8:block128x128",
]  # fmt: skip
MIXES = [
    "Q2_K",
    "Q3_K_S",
    "Q3_K_M",
    "Q3_K_L",
    "Q4_K_S",
    "Q4_K_M",
    "Q5_K_S",
    "Q5_K_M",
    "Q6_K",
    "Q8_0",
    "Q4_0",
    "Q3_K",
    "Q4_K",
    "Q5_K",
]
GGUF_TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
NO_DOWN = {"ignore": ["*down_proj*"]}  # tiny-llama's down_proj rows (128) are not whole 256-blocks


def _cases() -> list[Case]:
    cases: list[Case] = []
    add = cases.append
    # compressed-tensors, on the sample model: every preset and short form it stores
    for scheme in CT_SCHEMES:
        add(Case("tiny", "quantize", "out", scheme))
    add(Case("tiny", "quantize", "out.safetensors", "W4A16"))
    add(Case("tiny", "quantize", "out.safetensors", "NVFP4A16"))
    add(Case("tiny", "quantize", "out", "W4A16", {"dtype": "f16"}))
    add(Case("tiny", "quantize", "out", "W4A16", {"max_shard_size": "400KB"}))
    add(
        Case(
            "tiny", "quantize", "out", "W4A16", {"tensor_schemes": ["re:.*down_proj.*=W8A16", "*q_proj*=int4:g64:asym"]}
        )
    )
    add(Case("tiny", "quantize", "out", "int8", {"include": ["*proj*", "lm_head.weight"], "ignore": ["*k_proj*"]}))
    add(Case("sharded", "quantize", "out", "W4A16"))
    add(Case("sharded", "quantize", "out", "FP8_BLOCK"))
    # the mse observer (issue 19): C (int2/4/8) and torch (int3) searches
    for scheme in ("W4A16:mse", "W4A16_ASYM:mse", "int8:channel:mse", "int3:g64:asym:mse", "int2:g64:asym:mse"):
        add(Case("tiny", "quantize", "out", scheme))
    add(
        Case(
            "tiny", "quantize", "out", "W4A16", {"observer": "mse", "tensor_schemes": ["re:.*down_proj.*=W8A16:minmax"]}
        )
    )
    # bitsandbytes
    for scheme in ("nf4:g64", "nf4:g128", "nf4:g32"):
        add(Case("tiny", "quantize", "out", scheme))
    add(Case("tiny", "quantize", "out.safetensors", "nf4:g64"))
    # GGUF from a Hugging Face checkpoint: one type on the selected weights, and every mix
    for scheme in GGUF_TYPES:
        add(Case("tiny", "quantize", "out.gguf", scheme, NO_DOWN if scheme.endswith("_k") else {}))
    add(Case("tiny", "quantize", "out.gguf", "mxfp4", {"layout": "gguf"}))
    for mix in MIXES:
        add(Case("tiny", "quantize", "out.gguf", mix))
    add(Case("tiny", "quantize", "out.gguf", "Q4_K_M", {"tensor_schemes": ["*down_proj*=q8_0"]}))
    add(Case("sharded", "quantize", "out.gguf", "Q4_K_M"))
    # GGUF in, GGUF out: every mix on models made by gguf-py (fallbacks, F16 fallback, experts)
    for source in ("tiny2_f32", "gqa8_320", "odd4_272", "moe8"):
        for mix in MIXES:
            add(Case(source, "quantize", "out.gguf", mix))
    for scheme in GGUF_TYPES:
        add(Case("tiny2_f32", "quantize", "out.gguf", scheme))
    add(
        Case(
            "gqa8_320", "quantize", "out.gguf", "Q4_K_M", {"tensor_schemes": ["re:.*ffn_down.*=q6_k", "*attn_q*=Q8_0"]}
        )
    )
    add(Case("tiny2_f32", "quantize", "out.gguf", "mxfp4", {"layout": "gguf"}))
    # requantizing, and GGUF out of a quantized safetensors input
    add(Case("w4a16", "quantize", "out", "W8A16", {"allow_requantize": True}))
    add(Case("w4a16", "quantize", "out.gguf", "Q4_K_M", {"allow_requantize": True}))
    add(Case("fp8", "quantize", "out", "nf4:g64", {"allow_requantize": True}))
    # dequantize: plain safetensors
    for source in ("w4a16", "w8a16", "fp8"):
        add(Case(source, "dequantize", "out"))
        add(Case(source, "dequantize", "back.safetensors", options={"dtype": "f32"}))
    add(Case("tiny", "dequantize", "out", options={"dtype": "f16"}))
    # a real weight set: all-MiniLM-L6-v2 (BERT: GGUF only as an incomplete file)
    for scheme in (
        "W4A16",
        "W4A16_ASYM",
        "int8",
        "int2:g64:asym",
        "FP8_BLOCK",
        "NVFP4A16",
        "MXFP4A16",
        "nf4:g64",
        "W4A16:mse",
    ):
        add(Case("minilm", "quantize", "out", scheme))
    for scheme in ("q8_0", "Q4_K_M", "Q2_K"):
        add(Case("minilm", "quantize", "out.gguf", scheme, {"allow_incomplete_gguf": True}))
    return cases


CASES = _cases()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _placeholders(value: Any, paths: dict[str, str]) -> Any:
    """The document with machine-specific paths replaced by their role."""
    if isinstance(value, str):
        for path, role in paths.items():
            value = value.replace(path, role)
        return value
    if isinstance(value, list):
        return [_placeholders(v, paths) for v in value]
    if isinstance(value, dict):
        return {k: _placeholders(v, paths) for k, v in value.items()}
    return value


def _without_timing(document: Any) -> Any:
    """The document less what differs from run to run or checkout to checkout: time, and the
    revision of the git checkout the sample models sit in."""
    if isinstance(document, dict):
        return {k: _without_timing(v) for k, v in document.items() if k not in ("seconds", "revision")}
    if isinstance(document, list):
        return [_without_timing(v) for v in document]
    return document


def run_case(case: Case, folder: Path, inputs: Path) -> dict[str, Any]:
    """Run one case into `folder`; the files written (relative name -> sha256), the plan and
    the report, machine paths replaced."""
    import qtool

    source = SOURCES[case.source](inputs)
    output = folder / case.output
    if case.command == "quantize":
        options = dict(case.options)
        report = qtool.quantize(source, output, case.scheme, threads=2, **options)
    else:
        report = qtool.dequantize(source, output, threads=2, **case.options)
    files = [output] if output.is_file() else sorted(p for p in output.rglob("*") if p.is_file())
    hashes = {str(p.relative_to(folder)): _sha256(p) for p in files}
    paths = {str(output): "<output>", str(source): "<input>"}
    return {"files": hashes, "report": _placeholders(_without_timing(report.to_json()), paths)}


def _inspected() -> list[str]:
    """Every checkpoint file the repo ships (fixtures and sample models), relative to the repo:
    what `inspect --json` says of each must not change either."""
    suffixes = (".safetensors", ".gguf", ".pt", ".pth", ".bin", ".bpk")
    roots = [REPO / "tests" / "fixtures", SAMPLES]
    found = sorted(
        p for root in roots for p in root.rglob("*") if p.is_file() and p.suffix in suffixes and "fuzz" not in p.parts
    )
    return [str(p.relative_to(REPO)) for p in found]


INSPECTED = _inspected()


def inspect_case(relative: str) -> Any:
    """`inspect --json` of one shipped file (a refusal: its exit code and message)."""
    import qtool
    from qtool.errors import QtoolError

    try:
        return _placeholders(qtool.inspect(REPO / relative).to_json(), {str(REPO): "<repo>"})
    except QtoolError as exc:
        return {"refused": exc.exit_code, "message": str(exc).replace(str(REPO), "<repo>")}


def load() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


def main() -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true", help="rewrite the goldens of the selected cases")
    parser.add_argument("-k", default="", help="only the cases whose id contains this")
    args = parser.parse_args()
    goldens = load()
    changed = 0
    for relative in INSPECTED:
        key = f"inspect/{relative}"
        if args.k not in key:
            continue
        result = inspect_case(relative)
        if goldens.get(key) != result:
            changed += 1
            print(("updated " if args.update else "differs ") + key)
        goldens[key] = result
    with tempfile.TemporaryDirectory() as work:
        inputs = Path(work) / "inputs"
        inputs.mkdir()
        for index, case in enumerate(c for c in CASES if args.k in c.id):
            folder = Path(work) / f"case{index}"
            folder.mkdir()
            result = run_case(case, folder, inputs)
            if goldens.get(case.id) != result:
                changed += 1
                print(("updated " if args.update else "differs ") + case.id)
            goldens[case.id] = result
    if args.update:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(goldens, indent=1, sort_keys=True) + "\n")
    print(f"{changed} of {len(CASES) + len(INSPECTED)} cases {'updated' if args.update else 'differ'}")
    return 0 if args.update or not changed else 1


if __name__ == "__main__":
    sys.exit(main())
