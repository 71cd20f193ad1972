"""The C files of qtool/native/src form layers, as the Python modules do (tests/test_architecture.py):
no call cycle between them. A file calls another when it names a function the other defines
(non-static: the only way one C file reaches another); the calls between files must make a
directed acyclic graph, and so must the #includes. A cycle (gguf.c's decoder table calling
iq2_encode.c's decoders, iq2_encode.c calling kquant_encode.c's make_qp_quants, kquant_encode.c
calling back into gguf.c's decoders) means no file can be read, built or tested below the others.
The check is textual, which is enough for this code: every shared function is `qt_`-prefixed and
declared in qtool_native.h or iq_grid.h. It is shown to catch a cycle on a copy with one added."""

from __future__ import annotations

import graphlib
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO

SRC = REPO / "qtool" / "native" / "src"

# a definition at the start of a line: return type, then qt_name( -- not `static`, not a call
_DEFINITION = re.compile(r"^(?!static\b)(?:[A-Za-z_][\w]*[\s*]+)+(qt_\w+)\s*\([^;]*?\)\s*\{", re.M)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def _code(path: Path) -> str:
    return _COMMENT.sub(" ", path.read_text())


def call_graph(src: Path) -> dict[str, set[str]]:
    """{file: the other .c files whose functions it calls}."""
    codes = {path.name: _code(path) for path in sorted(src.glob("*.c"))}
    owner = {}
    for name, code in codes.items():
        for match in _DEFINITION.finditer(code):
            assert owner.setdefault(match[1], name) == name, f"{match[1]} is defined in {owner[match[1]]} and {name}"
    graph: dict[str, set[str]] = {name: set() for name in codes}
    for name, code in codes.items():
        for function in set(re.findall(r"\bqt_\w+", code)):
            if owner.get(function, name) != name:
                graph[name].add(owner[function])
    return graph


def include_graph(src: Path) -> dict[str, set[str]]:
    return {path.name: set(_INCLUDE.findall(_code(path))) for path in sorted([*src.glob("*.c"), *src.glob("*.h")])}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def test_the_c_files_call_each_other_without_a_cycle():
    graph = call_graph(SRC)
    assert graph["gguf_encode.c"] >= {"kquant_encode.c", "gguf.c"}, graph  # the parser sees real calls
    assert cycle(graph) is None, f"a call cycle: {' -> '.join(cycle(graph))}"


def test_the_headers_include_each_other_without_a_cycle():
    assert cycle(include_graph(SRC)) is None


def test_the_layer_check_catches_a_cycle(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(SRC, copy)
    with open(copy / "iq_grid.c", "a") as handle:  # the grid search, a leaf, calling an encoder back
        handle.write("\nvoid qt_iq_grid_upward(void) { qt_q4_k_row(0, 0, 0, 0, 0); }\n")
    found = cycle(call_graph(copy))
    assert found is not None and "iq_grid.c" in found


@pytest.mark.parametrize("source", ["common.c", "gguf.c", "kquant_encode.c", "kquant_common.c"])
def test_each_file_is_found_defining_what_the_header_declares(source):
    """The parser finds definitions (a regex that found none would find no cycle either)."""
    names = {m[1] for m in _DEFINITION.finditer(_code(SRC / source))}
    assert names, source
