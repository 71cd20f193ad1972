"""Every byte qtool writes, kept: each case of `tests/golden_outputs.py` (every layout × every
scheme and mix it stores) is run again and compared with the committed goldens, file hashes and
the report document both. A difference names the case and what differs; a golden is changed
only on purpose (`python -m tests.golden_outputs --update -k CASE`, reason in the commit)."""

from __future__ import annotations

import pytest

from tests.golden_outputs import CASES, INSPECTED, inspect_case, load, run_case

GOLDENS = load()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return tmp_path_factory.mktemp("golden-inputs")


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_output_is_unchanged(case, inputs, tmp_path):
    expected = GOLDENS.get(case.id)
    assert expected is not None, f"no golden for {case.id}: run python -m tests.golden_outputs --update -k '{case.id}'"
    result = run_case(case, tmp_path, inputs)
    assert result["files"] == expected["files"], (
        f"{case.id}: the files written differ: {differences(result['files'], expected['files'])}"
    )
    assert result["report"] == expected["report"], (
        f"{case.id}: the report differs: {differences(result['report'], expected['report'])}"
    )


@pytest.mark.parametrize("relative", INSPECTED)
def test_inspection_is_unchanged(relative):
    expected = GOLDENS.get(f"inspect/{relative}")
    assert expected is not None, (
        f"no golden for inspect/{relative}: run python -m tests.golden_outputs --update -k '{relative}'"
    )
    result = inspect_case(relative)
    assert result == expected, f"inspect {relative} differs: {differences(result, expected)}"


def differences(got, want, path: str = "") -> list[str]:
    """The first few paths where two JSON documents differ, with both values."""
    if isinstance(got, dict) and isinstance(want, dict):
        found = [
            d
            for key in sorted(set(got) | set(want), key=str)
            for d in differences(got.get(key), want.get(key), f"{path}.{key}")
        ]
    elif isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        found = [d for index, (a, b) in enumerate(zip(got, want)) for d in differences(a, b, f"{path}[{index}]")]
    else:
        found = [] if got == want else [f"{path or '.'}: {got!r} (golden {want!r})"]
    return found[:10]
