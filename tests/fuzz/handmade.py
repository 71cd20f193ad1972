"""Resource bombs and exact cases from issue 10 that random mutation is unlikely to hit, written
into the regression corpus as ordinary cases (the same runner, the same outcome classes).

    python -m tests.fuzz.handmade            # (re)writes tests/fuzz/regressions/*/handmade-*

- pt/handmade-billion-laughs: `L = [L, L]` 40 deep under one tensor, 1.9 kB; torch.load shares
  the memo references, a state-dict walk that expands them never ends.
- pt_legacy/handmade-billion-laughs: the same in the legacy (non-zip) format.
- gguf/handmade-dims-overflow-*: a tensor with dims [0, 64, 2^62], through `inspect --stats`
  and `check --no-nan` (size arithmetic that overflows).

Issue 18 (#4-#7):

- pt/handmade-aliased-*, pt_legacy/handmade-aliased: one memoized tensor under 70,000 names
  (7 bytes a name; 1.2M names took 174 s and 2 GB), and 65,538 beside 10 tensors (the describer's
  own cap, past the machine's allowance).
- gguf/handmade-scale-overflow-*: a finite 3e38 through `quantize` at Q8_0, Q4_0, Q4_K_M and
  q6_k (the f16 block scale overflows: exit 2, or finite output); handmade-nan-*/inf-*:
  non-finite inputs, encoded and reported.
- side_json/handmade-side-swap-*: a model folder whose vocab.json becomes a link out of the
  folder, a FIFO or /dev/zero once merges.txt is copied (runner._swap_during_copy).

Issue 18 (#8), giant names: every stderr line at most `expect.max_line` characters.

- gguf/handmade-giant-name-*: a tensor name that swallowed the tensor table (its length field
  covers the next tensor's info and runs on), through `inspect` and `quantize`; and a 16 KB
  name that is otherwise valid, refused by `quantize` (GGUF names are at most 63 bytes).
- safetensors/handmade-giant-name-*: a 16 KB tensor name with an unknown dtype, and with a
  shape its bytes do not fill.

Issue 42 (#1, #2, #5): side_json/handmade-calibrate-*, hostile model folders at calibration's
door to transformers (`tests/fuzz/hostile_folders.py`): an `auto_map` to the folder's own code,
terminal escapes and unknown names in config values, a config the weights belie.
"""

from __future__ import annotations

import json
import struct
import sys
import tempfile
from pathlib import Path

from tests.fuzz.campaign import Case

HERE = Path(__file__).resolve().parent


def billion_laughs(path: Path, depth: int = 40, legacy: bool = False) -> None:
    import torch

    nest: list = [torch.zeros(2)]
    for _ in range(depth):
        nest = [nest, nest]
    torch.save({"model": nest}, path, _use_new_zipfile_serialization=not legacy)


def gguf_dims_overflow(path: Path) -> None:
    """One F32 tensor whose dims are [0, 64, 2^62]: zero elements, and a product of the others
    that overflows 64 bits once multiplied by the element size."""
    import gguf
    import numpy as np

    with tempfile.TemporaryDirectory() as scratch:
        plain = Path(scratch) / "plain.gguf"
        writer = gguf.GGUFWriter(str(plain), "llama")
        writer.add_tensor("output.weight", np.arange(16, dtype=np.float32).reshape(2, 8))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        data = bytearray(plain.read_bytes())
    from tests.fuzz.structure import parse

    s = parse("plain.gguf", bytes(data))
    dims = [f for f in s.fields if f.kind == "dim"]
    info_end = next(r.end for r in s.regions if r.kind == "tensor_info")
    old_data = -(-info_end // 32) * 32
    start = dims[0].offset
    struct.pack_into("<I", data, start - 4, 3)
    head = bytes(data[:start]) + struct.pack("<3Q", 0, 64, 2**62) + bytes(data[dims[-1].offset + 8 : info_end])
    path.write_bytes(head + bytes(-len(head) % 32) + bytes(data[old_data:]))


def aliased(path: Path, names: int, legacy: bool = False, beside: int = 0) -> None:
    import torch

    one = torch.zeros(2)
    state = {f"t{index}": torch.zeros(1) for index in range(beside)}
    state.update({index: one for index in range(names)})
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)


def gguf_holding(path: Path, value: float) -> None:
    """One 16x256 F32 weight (one K-quant block a row), gaussian, with `value` at one place."""
    import gguf
    import numpy as np

    x = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    x[3, 5] = value
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.attn_q.weight", x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


GIANT = "blk.0.attn_q.weight" + "X" * 16_000  # 16 KB: what a name that swallowed a table echoes
MAX_LINE = 600  # a message line with a name cut to message_text.NAME_LIMIT (200) and its text


def gguf_named(path: Path, names: list[str]) -> None:
    """A GGUF with one 4x32 F32 tensor under each name."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    for name in names:
        writer.add_tensor(name, np.ones((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_name_swallowing_the_table(path: Path) -> None:
    """Two tensors; the first name's length grown by 16,000, so it reads the second tensor's
    info, the padding and the data as its own bytes, and the table after it is garbage."""
    gguf_named(path, ["blk.0.attn_q.weight", "blk.0.attn_k.weight"])
    raw = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = raw.index(struct.pack("<Q", len(name)) + name)
    raw[at : at + 8] = struct.pack("<Q", len(name) + 16_000)
    path.write_bytes(bytes(raw) + b"Y" * 20_000)  # the grown name is inside the file


def safetensors_named(name: str, dtype: str, shape: list[int], nbytes: int) -> bytes:
    header = json.dumps({name: {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(nbytes)


def side_swap_model() -> dict[str, bytes]:
    """A llama folder with one 8x128 weight, merges.txt and vocab.json: the files of a swap case."""
    import numpy as np

    from tests.fuzz.seeds import SAMPLES, safetensors_bytes

    weight = np.linspace(-1, 1, 8 * 128, dtype=np.float32).tobytes()
    return {
        "m/config.json": (SAMPLES / "tiny-llama" / "config.json").read_bytes(),
        "m/model.safetensors": safetensors_bytes({"model.layers.0.self_attn.q_proj.weight": ("F32", [8, 128], weight)}),
        "m/merges.txt": b"#version: 0.2\n" + b"a b\n" * 1000,
        "m/vocab.json": b'{"a": 0, "b": 1}',
    }


def write_all(regressions: Path) -> list[Path]:
    written = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        billion_laughs(scratch / "model.pt")
        billion_laughs(scratch / "legacy.pt", legacy=True)
        gguf_dims_overflow(scratch / "model.gguf")
        cases = [
            ("pt", "handmade-billion-laughs", "model.pt", ["inspect", "{in}"], "model.pt", "L = [L, L] nested 40 deep (torch.save shares the memo references): 1.9 kB", "torchpt"),
            ("pt_legacy", "handmade-billion-laughs", "model.pt", ["inspect", "{in}"], "legacy.pt", "L = [L, L] nested 40 deep, legacy format", "torchpt"),
            ("gguf", "handmade-dims-overflow-stats", "model.gguf", ["inspect", "{in}", "--stats"], "model.gguf", "dims [0, 64, 2^62]", "readers"),
            ("gguf", "handmade-dims-overflow-no-nan", "model.gguf", ["check", "{in}", "--no-nan"], "model.gguf", "dims [0, 64, 2^62]", "readers"),
        ]
        aliased(scratch / "aliased.pt", 70_000)
        aliased(scratch / "aliased-legacy.pt", 70_000, legacy=True)
        aliased(scratch / "aliased-beside.pt", 65_538, beside=10)  # 10 calls: past the machine's allowance, not the describer's
        cases += [
            ("pt", "handmade-aliased", "model.pt", ["inspect", "{in}"], "aliased.pt", "one tensor under 70,000 names", "torchpt"),
            ("pt_legacy", "handmade-aliased", "model.pt", ["inspect", "{in}"], "aliased-legacy.pt", "one tensor under 70,000 names, legacy format", "torchpt"),
            ("pt", "handmade-aliased-beside-tensors", "model.pt", ["inspect", "{in}"], "aliased-beside.pt", "one tensor under 65,538 names beside 10 tensors", "torchpt"),
        ]
        for label, value in (("scale-overflow", 3e38), ("nan", float("nan")), ("inf", float("inf"))):
            gguf_holding(scratch / f"{label}.gguf", value)
        expect: dict[str, dict] = {name: {"outcome": "exit2-one-line"} for _, name, *_ in cases if "aliased" in name}
        warning = "warning: blk.0.attn_q.weight holds {} values: encoded as its toolchain does, no error figure (see `qtool check --no-nan`)"
        for label, scheme, wanted in (
            ("scale-overflow", "Q8_0", {"outcome": "exit2-one-line"}),
            ("scale-overflow", "Q4_0", {"outcome": "exit2-one-line"}),
            ("scale-overflow", "Q4_K_M", {"outcome": "exit2-one-line"}),
            ("scale-overflow", "q6_k", {"outcome": "exit0", "stderr": []}),  # finite scales: 3e38 is lost, the SQNR says so
            ("nan", "Q8_0", {"outcome": "exit0", "stderr": [warning.format("NaN")]}),
            ("nan", "q6_k", {"outcome": "exit0", "stderr": [warning.format("NaN")]}),
            ("inf", "Q4_K_M", {"outcome": "exit0", "stderr": [warning.format("inf")]}),
        ):
            argv = ["quantize", "{in}", "-o", "{out}.gguf", "--scheme", scheme, "--json", "-q"]
            name = f"handmade-{label}-{scheme.lower()}"
            cases.append(("gguf", name, "model.gguf", argv, f"{label}.gguf", f"{label} weight at {scheme}", "encoders"))
            expect[name] = wanted
        gguf_name_swallowing_the_table(scratch / "swallowed.gguf")
        gguf_named(scratch / "giant.gguf", [GIANT])
        (scratch / "giant-dtype.safetensors").write_bytes(safetensors_named(GIANT, "F99", [2], 8))
        (scratch / "giant-short.safetensors").write_bytes(safetensors_named(GIANT, "F32", [4], 8))
        giant = {"outcome": "exit2-one-line", "max_line": MAX_LINE}
        for container, name, target, argv, source, what in (
            ("gguf", "handmade-giant-name-swallowed-table-inspect", "model.gguf", ["inspect", "{in}"], "swallowed.gguf", "a tensor name that swallowed the tensor table"),
            ("gguf", "handmade-giant-name-swallowed-table-quantize", "model.gguf", ["quantize", "{in}", "-o", "{out}.gguf", "--scheme", "Q8_0", "-q"], "swallowed.gguf", "a tensor name that swallowed the tensor table, quantized"),
            ("gguf", "handmade-giant-name-quantize", "model.gguf", ["quantize", "{in}", "-o", "{out}.gguf", "--scheme", "Q8_0", "-q"], "giant.gguf", "a 16 KB tensor name, quantized to GGUF"),
            ("safetensors", "handmade-giant-name-dtype", "model.safetensors", ["inspect", "{in}"], "giant-dtype.safetensors", "a 16 KB tensor name with an unknown dtype"),
            ("safetensors", "handmade-giant-name-short", "model.safetensors", ["quantize", "{in}", "-o", "{out}", "--scheme", "int8", "-q"], "giant-short.safetensors", "a 16 KB tensor name whose bytes are short"),
        ):
            cases.append((container, name, target, argv, source, what, "messages"))
            expect[name] = giant
        for container, name, target, argv, source, what, area in cases:
            case = Case(container, "handmade", target, argv, [f"handmade: {what}"], {target: (scratch / source).read_bytes()})
            folder = regressions / container / name
            extra = {"area": area, "signature": ["handmade", what, area]} | ({"expect": expect[name]} if name in expect else {})
            case.write(folder, extra=extra)
            written.append(folder)
    model = side_swap_model()
    for kind, to in (("link-out", "/etc/passwd"), ("fifo", "fifo"), ("dev-zero", "/dev/zero")):
        swap = {"after": "merges.txt", "path": "in/m/vocab.json", "to": to}
        what = f"vocab.json swapped for {to} while merges.txt is copied"
        case = Case("side_json", "handmade", "m", ["quantize", "{in}", "-o", "{out}", "-q"], [f"handmade: {what}"], model, env={"QTOOL_FUZZ_SWAP": json.dumps(swap)})
        folder = regressions / "side_json" / f"handmade-side-swap-{kind}"
        case.write(folder, extra={"area": "side_files", "signature": ["handmade", what, "side_files"], "expect": {"outcome": "exit2-one-line"}})
        written.append(folder)
    from tests.fuzz.hostile_folders import write_cases

    return written + write_cases(regressions)


if __name__ == "__main__":
    for folder in write_all(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "regressions"):
        print(folder)
