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

Issue 42 (#3, #8), special files where a file is read whole (`case.json`'s `special`: git keeps
no FIFO, and a link to /dev/zero must not be read when the case is loaded):

- side_json/handmade-calibration-{fifo,dev-zero}: a `--calibrate` folder whose `a.txt` is a
  FIFO or a link to /dev/zero (open() hung; /dev/zero was read to 1 GiB and tokenized), and
  the `imatrix` command given such a text;
- gguf/handmade-imatrix-*: `--imatrix /dev/zero`, a `.dat` linked to it (read to MemoryError)
  and a FIFO `.gguf` (hung);
- side_json/handmade-git-head-fifo: the model folder's `.git/HEAD` a FIFO (the report's
  revision lookup hung, after the output was committed): exit 0, the revision unknown.

- gguf/handmade-giant-name-*: a tensor name that swallowed the tensor table (its length field
  covers the next tensor's info and runs on), through `inspect` and `quantize`; and a 16 KB
  name that is otherwise valid, refused by `quantize` (GGUF names are at most 63 bytes).
- safetensors/handmade-giant-name-*: a 16 KB tensor name with an unknown dtype, and with a
  shape its bytes do not fill.

Issue 42 (#6, #7, #11, #12), hostile text (`write_issue_42`):

- pt/handmade-surrogate-key-*, pt_legacy/handmade-surrogate-key-*: a key holding a lone
  surrogate (`\\ud800` through the pickle's UNICODE opcode): refused at read, exit 2, never a
  half-written `--json` and exit 70.
- safetensors/handmade-spaced-control-name: a 16 KB name of control characters and spaces,
  escaped once and cut in the one error line.
- safetensors/handmade-evil-regex-*: `re:(a|aa)+$` as --tensor-scheme and --filter against a
  name of 40 a's: refused past the match bound, exit 2; handmade-issue-regex-*: the issue's
  `.*(a+)+$`, which the regex module matches at once (exit 0).
- gguf/handmade-iq-*-scale-dequantize: IQ blocks whose f16 scale is NaN or inf: written as they
  decode, with one warning naming the weight.

Issue 37, torchao names a torch pickle may hold (`write_issue_37`): pt/handmade-torchao-*, the
torchao fixture's pickle with its Int8Tensor global renamed to a class torchao lacks (a bit flip's
`Int8Tensoq`), to a torchao function (`quantize_`), and to a quantize_ configuration: refused from
qtool's table of torchao's classes, never by importing the module the pickle names (which took
torch and torchao's import, 12+ s, to refuse one).

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


def gguf_iq_scaled(path: Path, type_name: str, scale: float, rows: int = 4) -> None:
    """One 4x256 tensor of GGUF IQ type `type_name` from seeded random code bytes, every block's
    f16 scale `d` (its first two bytes) 0.01 except the first block's, which is `scale` (NaN or
    inf: a decoded block that comes out non-finite, issue 42 #11)."""
    import gguf
    import numpy as np

    gtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[gtype]
    blocks = rows * 256 // block
    raw = bytearray(np.random.default_rng(0).integers(0, 256, blocks * size, dtype=np.uint8).tobytes())
    for index in range(blocks):
        raw[index * size : index * size + 2] = np.float16(0.01).tobytes()
    raw[0:2] = np.float16(scale).tobytes()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.attn_q.weight", np.frombuffer(bytes(raw), np.uint8).reshape(rows, -1), raw_dtype=gtype)
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


def surrogate_key_pt(path: Path, legacy: bool = False) -> None:
    """A torch checkpoint whose key `a\\ud800b.weight` is spelled with the pickle's protocol-0
    UNICODE opcode (raw-unicode-escape), the one opcode that can make a lone UTF-16 surrogate:
    torch.save's own BINUNICODE is strict UTF-8. Beside it, a plain `c.weight`."""
    import io
    import zipfile

    import torch

    buffer = io.BytesIO()
    torch.save(
        {"aXb.weight": torch.ones(4, 4), "c.weight": torch.ones(2, 2)},
        buffer,
        _use_new_zipfile_serialization=not legacy,
    )
    old = b"X" + struct.pack("<I", 10) + b"aXb.weight"
    new = b"Va\\ud800b.weight\n"
    if legacy:
        assert buffer.getvalue().count(old) == 1
        path.write_bytes(buffer.getvalue().replace(old, new))
        return
    with zipfile.ZipFile(buffer) as source, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("data.pkl"):
                assert data.count(old) == 1
                data = data.replace(old, new)
            target.writestr(info.filename, data)


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


def special_file_cases(regressions: Path) -> list[Path]:
    """Issue 42 (#3, #8): the special files a run reads whole, made when the case is written."""
    written = []
    model = {
        name: data
        for name, data in side_swap_model().items()
        if name.startswith("m/") and not name.endswith((".txt", ".json")) or name == "m/config.json"
    }
    text = ("An iterator is created for the result of the expression list. " * 40).encode()
    gguf_scratch = tempfile.TemporaryDirectory()
    gguf_holding(Path(gguf_scratch.name) / "model.gguf", 0.5)
    weights = (Path(gguf_scratch.name) / "model.gguf").read_bytes()
    gguf_scratch.cleanup()
    calibrate = ["quantize", "{in}", "-o", "{out}", "--calibrate", "in/texts", "--samples", "1", "--seq-len", "2", "-q"]
    imatrix_command = ["imatrix", "{in}", "--calibrate", "in/texts/a.txt", "-o", "{out}.gguf", "--chunk-size", "16"]
    cases = []
    refused_text = [
        "error: in/texts/a.txt: cannot be read: it is not a regular file",
        "hint: a calibration text is a .txt or .jsonl file, or a folder of them",
    ]
    for kind, to in (("fifo", "fifo"), ("dev-zero", "/dev/zero")):
        files = {**model, "texts/0.txt": text}
        cases.append(
            (
                "side_json",
                f"handmade-calibration-{kind}",
                "m",
                calibrate,
                files,
                {"texts/a.txt": to},
                f"a --calibrate folder whose a.txt is {to}",
                "calibration",
                refused_text,
            )
        )
        cases.append(
            (
                "side_json",
                f"handmade-imatrix-text-{kind}",
                "m",
                imatrix_command,
                files,
                {"texts/a.txt": to},
                f"the imatrix command's text a.txt is {to}",
                "calibration",
                refused_text,
            )
        )
    quantize_imatrix = ["quantize", "{in}", "-o", "{out}.gguf", "--scheme", "Q4_K_M", "-q", "--imatrix"]
    for name, path, special in (
        ("handmade-imatrix-dev-zero", "/dev/zero", {}),
        ("handmade-imatrix-dat-dev-zero", "in/i.dat", {"i.dat": "/dev/zero"}),
        ("handmade-imatrix-fifo", "in/i.gguf", {"i.gguf": "fifo"}),
        ("handmade-imatrix-dat-fifo", "in/i.dat", {"i.dat": "fifo"}),
    ):
        refused = [
            f"error: {path}: cannot read: it is not a regular file",
            "hint: pass the .gguf or .dat file llama-imatrix wrote",
        ]
        cases.append(
            (
                "gguf",
                name,
                "model.gguf",
                [*quantize_imatrix, path],
                {"model.gguf": weights},
                special,
                f"--imatrix {path} is {special.get(path[3:], path)}",
                "formats.imatrix",
                refused,
            )
        )
    cases.append(
        (
            "side_json",
            "handmade-git-head-fifo",
            "m",
            ["quantize", "{in}", "-o", "{out}", "--json", "-q"],
            model,
            {"m/.git/HEAD": "fifo"},
            "the model folder's .git/HEAD is a FIFO",
            "formats.revision",
            [],
        )
    )
    for container, name, target, argv, files, special, what, area, stderr in cases:
        case = Case(container, "handmade", target, argv, [f"handmade: {what}"], files, special=special)
        folder = regressions / container / name
        expect = {"outcome": "exit2-one-line" if stderr else "exit0", "stderr": stderr}
        case.write(folder, extra={"area": area, "signature": ["handmade", what, area], "expect": expect})
        for made in special:  # the case folder keeps only what git can keep: Case.write makes these
            path = folder / "in" / made
            path.unlink()
            while path.parent != folder / "in" and not any(path.parent.iterdir()):
                path = path.parent
                path.rmdir()
        written.append(folder)
    return written


EVIL_REGEX = "re:(a|aa)+$"  # backtracks catastrophically in Python's re on 40 a's and a mismatch
SPACED_NAME = "\x01 " * 8000  # a 16 KB name of control characters and spaces: escaped once, then cut


def write_issue_42(regressions: Path, scratch: Path) -> list[Path]:
    """Issue 42's hostile text: lone surrogates, runaway user regexes, a long spaced name, and
    IQ blocks whose scales decode to NaN/inf."""
    from tests.fuzz.seeds import safetensors_bytes

    surrogate_key_pt(scratch / "surrogate.pt")
    surrogate_key_pt(scratch / "surrogate-legacy.pt", legacy=True)
    (scratch / "spaced.safetensors").write_bytes(safetensors_named(SPACED_NAME, "F32", [4], 8))
    evil_names = ("a" * 40 + ".weight", "b.weight")
    weight = bytes(4 * 8 * 128)
    (scratch / "evil.safetensors").write_bytes(
        safetensors_bytes({name: ("F32", [8, 128], weight) for name in evil_names})
    )
    gguf_iq_scaled(scratch / "iq-nan.gguf", "IQ4_NL", float("nan"))
    gguf_iq_scaled(scratch / "iq-inf.gguf", "IQ2_XXS", float("inf"))
    refused = {"outcome": "exit2-one-line"}
    decodes = "warning: blk.0.attn_q.weight decodes to {} values: written as they decode (see `qtool check --no-nan`)"
    cases = [
        (
            "pt",
            "handmade-surrogate-key-inspect-json",
            "model.pt",
            ["inspect", "{in}", "--json"],
            "surrogate.pt",
            "a key holding a lone surrogate (pickle UNICODE opcode), inspect --json",
            "torchpt",
            refused,
        ),
        (
            "pt",
            "handmade-surrogate-key-quantize",
            "model.pt",
            ["quantize", "{in}", "-o", "{out}", "--scheme", "int8", "-q"],
            "surrogate.pt",
            "a key holding a lone surrogate, quantized",
            "torchpt",
            refused,
        ),
        (
            "pt_legacy",
            "handmade-surrogate-key-inspect-json",
            "model.pt",
            ["inspect", "{in}", "--json"],
            "surrogate-legacy.pt",
            "a key holding a lone surrogate, legacy format, inspect --json",
            "torchpt",
            refused,
        ),
        (
            "safetensors",
            "handmade-spaced-control-name",
            "model.safetensors",
            ["inspect", "{in}"],
            "spaced.safetensors",
            "a 16 KB name of control characters and spaces, cut in the one error line",
            "messages",
            {"outcome": "exit2-one-line", "max_line": MAX_LINE},
        ),
        (
            "safetensors",
            "handmade-evil-regex-tensor-scheme",
            "model.safetensors",
            [
                "quantize",
                "{in}",
                "-o",
                "{out}",
                "--scheme",
                "W4A16",
                "--tensor-scheme",
                EVIL_REGEX + "=W8A16",
                "--dry-run",
            ],
            "evil.safetensors",
            "a backtracking --tensor-scheme regex against a name of 40 a's",
            "patterns",
            refused,
        ),
        (
            "safetensors",
            "handmade-evil-regex-filter",
            "model.safetensors",
            ["inspect", "{in}", "-k", EVIL_REGEX],
            "evil.safetensors",
            "a backtracking --filter regex against a name of 40 a's",
            "patterns",
            refused,
        ),
        (
            "safetensors",
            "handmade-issue-regex-tensor-scheme",
            "model.safetensors",
            [
                "quantize",
                "{in}",
                "-o",
                "{out}",
                "--scheme",
                "W4A16",
                "--tensor-scheme",
                "re:.*(a+)+$=W8A16",
                "--dry-run",
            ],
            "evil.safetensors",
            "the issue's .*(a+)+$ against a name of 40 a's: the regex module matches it at once",
            "patterns",
            {"outcome": "exit0"},
        ),
        (
            "gguf",
            "handmade-iq-nan-scale-dequantize",
            "model.gguf",
            ["dequantize", "{in}", "-o", "{out}.safetensors", "--json", "-q"],
            "iq-nan.gguf",
            "an IQ4_NL block whose f16 scale is NaN, dequantized",
            "pipeline",
            {"outcome": "exit0", "stderr": [decodes.format("NaN")]},
        ),
        (
            "gguf",
            "handmade-iq-inf-scale-dequantize",
            "model.gguf",
            ["dequantize", "{in}", "-o", "{out}.safetensors", "--dtype", "f32", "-q"],
            "iq-inf.gguf",
            "an IQ2_XXS block whose f16 scale is inf, dequantized",
            "pipeline",
            {"outcome": "exit0", "stderr": [decodes.format("inf")]},
        ),
    ]
    written = []
    for container, name, target, argv, source, what, area, expect in cases:
        case = Case(
            container, "handmade", target, argv, [f"handmade: {what}"], {target: (scratch / source).read_bytes()}
        )
        folder = regressions / container / name
        case.write(folder, extra={"area": area, "signature": ["handmade", what, area], "expect": expect})
        written.append(folder)
    return written


TORCHAO_INT8 = b"ctorchao.quantization\nInt8Tensor\n"  # the fixture pickle's global (protocol 2)


def write_issue_37(regressions: Path) -> list[Path]:
    """Issue 37: the torchao fixture's pickle naming torchao globals qtool does not rebuild."""
    import zipfile
    from io import BytesIO

    fixture = HERE.parent / "fixtures" / "torchao" / "model.pt"
    written = []
    for name, replacement, what in (
        (
            "handmade-torchao-unknown-class",
            b"ctorchao.quantization\nInt8Tensoq\n",
            "a torchao class torchao lacks (Int8Tensoq)",
        ),
        (
            "handmade-torchao-function",
            b"ctorchao.quantization\nquantize_\n",
            "a torchao function (quantize_) where a tensor subclass was",
        ),
        (
            "handmade-torchao-config",
            b"ctorchao.quantization.quant_api\nInt8WeightOnlyConfig\n",
            "a torchao quantize_ configuration where a tensor subclass was",
        ),
    ):
        buffer = BytesIO()
        with zipfile.ZipFile(fixture) as source, zipfile.ZipFile(buffer, "w") as out:
            for info in source.infolist():
                data = source.read(info)
                out.writestr(
                    info, data.replace(TORCHAO_INT8, replacement) if info.filename.endswith("data.pkl") else data
                )
        case = Case(
            "pt",
            "handmade",
            "model.pt",
            ["inspect", "{in}", "--json"],
            [f"handmade: {what}"],
            {"model.pt": buffer.getvalue()},
        )
        folder = regressions / "pt" / name
        case.write(
            folder,
            extra={
                "area": "torchpt",
                "signature": ["handmade", what, "torchpt"],
                "expect": {"outcome": "exit2-one-line"},
            },
        )
        written.append(folder)
    return written


def write_all(regressions: Path) -> list[Path]:
    written = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        billion_laughs(scratch / "model.pt")
        billion_laughs(scratch / "legacy.pt", legacy=True)
        gguf_dims_overflow(scratch / "model.gguf")
        cases = [
            (
                "pt",
                "handmade-billion-laughs",
                "model.pt",
                ["inspect", "{in}"],
                "model.pt",
                "L = [L, L] nested 40 deep (torch.save shares the memo references): 1.9 kB",
                "torchpt",
            ),
            (
                "pt_legacy",
                "handmade-billion-laughs",
                "model.pt",
                ["inspect", "{in}"],
                "legacy.pt",
                "L = [L, L] nested 40 deep, legacy format",
                "torchpt",
            ),
            (
                "gguf",
                "handmade-dims-overflow-stats",
                "model.gguf",
                ["inspect", "{in}", "--stats"],
                "model.gguf",
                "dims [0, 64, 2^62]",
                "readers",
            ),
            (
                "gguf",
                "handmade-dims-overflow-no-nan",
                "model.gguf",
                ["check", "{in}", "--no-nan"],
                "model.gguf",
                "dims [0, 64, 2^62]",
                "readers",
            ),
        ]
        aliased(scratch / "aliased.pt", 70_000)
        aliased(scratch / "aliased-legacy.pt", 70_000, legacy=True)
        aliased(
            scratch / "aliased-beside.pt", 65_538, beside=10
        )  # 10 calls: past the machine's allowance, not the describer's
        cases += [
            (
                "pt",
                "handmade-aliased",
                "model.pt",
                ["inspect", "{in}"],
                "aliased.pt",
                "one tensor under 70,000 names",
                "torchpt",
            ),
            (
                "pt_legacy",
                "handmade-aliased",
                "model.pt",
                ["inspect", "{in}"],
                "aliased-legacy.pt",
                "one tensor under 70,000 names, legacy format",
                "torchpt",
            ),
            (
                "pt",
                "handmade-aliased-beside-tensors",
                "model.pt",
                ["inspect", "{in}"],
                "aliased-beside.pt",
                "one tensor under 65,538 names beside 10 tensors",
                "torchpt",
            ),
        ]
        for label, value in (("scale-overflow", 3e38), ("nan", float("nan")), ("inf", float("inf"))):
            gguf_holding(scratch / f"{label}.gguf", value)
        expect: dict[str, dict] = {name: {"outcome": "exit2-one-line"} for _, name, *_ in cases if "aliased" in name}
        warning = "warning: blk.0.attn_q.weight holds {} values: encoded as its toolchain does, no error figure (see `qtool check --no-nan`)"
        for label, scheme, wanted in (
            ("scale-overflow", "Q8_0", {"outcome": "exit2-one-line"}),
            ("scale-overflow", "Q4_0", {"outcome": "exit2-one-line"}),
            ("scale-overflow", "Q4_K_M", {"outcome": "exit2-one-line"}),
            (
                "scale-overflow",
                "q6_k",
                {"outcome": "exit0", "stderr": []},
            ),  # finite scales: 3e38 is lost, the SQNR says so
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
            (
                "gguf",
                "handmade-giant-name-swallowed-table-inspect",
                "model.gguf",
                ["inspect", "{in}"],
                "swallowed.gguf",
                "a tensor name that swallowed the tensor table",
            ),
            (
                "gguf",
                "handmade-giant-name-swallowed-table-quantize",
                "model.gguf",
                ["quantize", "{in}", "-o", "{out}.gguf", "--scheme", "Q8_0", "-q"],
                "swallowed.gguf",
                "a tensor name that swallowed the tensor table, quantized",
            ),
            (
                "gguf",
                "handmade-giant-name-quantize",
                "model.gguf",
                ["quantize", "{in}", "-o", "{out}.gguf", "--scheme", "Q8_0", "-q"],
                "giant.gguf",
                "a 16 KB tensor name, quantized to GGUF",
            ),
            (
                "safetensors",
                "handmade-giant-name-dtype",
                "model.safetensors",
                ["inspect", "{in}"],
                "giant-dtype.safetensors",
                "a 16 KB tensor name with an unknown dtype",
            ),
            (
                "safetensors",
                "handmade-giant-name-short",
                "model.safetensors",
                ["quantize", "{in}", "-o", "{out}", "--scheme", "int8", "-q"],
                "giant-short.safetensors",
                "a 16 KB tensor name whose bytes are short",
            ),
        ):
            cases.append((container, name, target, argv, source, what, "messages"))
            expect[name] = giant
        for container, name, target, argv, source, what, area in cases:
            case = Case(
                container, "handmade", target, argv, [f"handmade: {what}"], {target: (scratch / source).read_bytes()}
            )
            folder = regressions / container / name
            extra = {"area": area, "signature": ["handmade", what, area]} | (
                {"expect": expect[name]} if name in expect else {}
            )
            case.write(folder, extra=extra)
            written.append(folder)
        written += write_issue_42(regressions, scratch)
        written += write_issue_37(regressions)
    model = side_swap_model()
    for kind, to in (("link-out", "/etc/passwd"), ("fifo", "fifo"), ("dev-zero", "/dev/zero")):
        swap = {"after": "merges.txt", "path": "in/m/vocab.json", "to": to}
        what = f"vocab.json swapped for {to} while merges.txt is copied"
        case = Case(
            "side_json",
            "handmade",
            "m",
            ["quantize", "{in}", "-o", "{out}", "-q"],
            [f"handmade: {what}"],
            model,
            env={"QTOOL_FUZZ_SWAP": json.dumps(swap)},
        )
        folder = regressions / "side_json" / f"handmade-side-swap-{kind}"
        case.write(
            folder,
            extra={
                "area": "side_files",
                "signature": ["handmade", what, "side_files"],
                "expect": {"outcome": "exit2-one-line"},
            },
        )
        written.append(folder)
    from tests.fuzz.hostile_folders import write_cases

    return written + special_file_cases(regressions) + write_cases(regressions)


if __name__ == "__main__":
    for folder in write_all(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "regressions"):
        print(folder)
