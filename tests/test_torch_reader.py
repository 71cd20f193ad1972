"""qtool's own PyTorch reader (no torch, no code run): legacy files, TorchScript archives, the
issue-10 regression files, resource bombs, and the pickle interpreter on malformed input.

Fixtures: tests/fixtures/torch_legacy/ and tests/fixtures/torch_bad/
(make_torch_reader_fixtures.py). Values are checked against torch.load(weights_only=True).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import tracemalloc
import warnings
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.conventions import decoder_for
from qtool.errors import CheckpointError
from qtool.formats.pickle_machine import PDict, PickleError, interpret
from qtool.formats.torch_pickle import TorchCheckpoint
from qtool.formats.torch_unpickle import Refused, Storage, TorchHooks
from qtool.formats.zip_directory import ZipDirectory, ZipError

HERE = Path(__file__).resolve().parent
LEGACY = HERE / "fixtures" / "torch_legacy"
BAD = HERE / "fixtures" / "torch_bad"
TORCH = HERE / "fixtures" / "torch"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("QTOOL_DEBUG", raising=False)


def flatten(value, name: str = "") -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    if isinstance(value, torch.Tensor):
        found[name] = value.int_repr() if value.is_quantized else value
    elif isinstance(value, dict):
        for key, item in value.items():
            found.update(flatten(item, f"{name}.{key}" if name else str(key)))
    return found


def assert_reads_as_torch_does(path: Path, key: str | None = None) -> TorchCheckpoint:
    checkpoint = qtool.open_checkpoint(path)
    assert isinstance(checkpoint, TorchCheckpoint)
    state = torch.load(path, weights_only=True)
    reference = flatten(state[key] if key else state)
    assert set(checkpoint.tensors) >= set(reference)
    for name, expected in reference.items():
        stored = checkpoint.tensors[name]
        assert stored.shape == tuple(expected.shape), name
        got = checkpoint.load(stored)
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
        assert (
            bytes(checkpoint.read_bytes(stored))
            == expected.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        ), name
        if stored.in_file:
            with open(path, "rb") as handle:
                handle.seek(stored.begin)
                assert handle.read(stored.nbytes) == bytes(checkpoint.read_bytes(stored)), name
    return checkpoint


def exit_2(path: Path, text: str, *args: str) -> str:
    result = runner.invoke(app, ["inspect", str(path), *args])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: {path}:") and text in lines[0], lines
    assert "Traceback" not in result.stderr
    return lines[0]


# -- legacy files -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["simple_legacy.pt", "legacy_shared_storage.pt", "legacy_uncloned_views.pt"])
def test_legacy_files_read_as_torch_load_reads_them(name):
    assert_reads_as_torch_does(LEGACY / name)


def test_legacy_views_offsets_and_strides_give_torchs_values():
    checkpoint = assert_reads_as_torch_does(LEGACY / "legacy_with_offsets.pt", "model")
    assert checkpoint.metadata["torch.state_dict"] == "model" and checkpoint.metadata["epoch"] == "7"
    tensors = checkpoint.tensors
    assert tensors["rows"].in_file and not tensors["transposed"].in_file and not tensors["stepped"].in_file
    assert tensors["empty"].nbytes == 0 and tensors["scalar"].shape == ()
    transposed = tensors["transposed"]
    assert transposed.begin >= os.path.getsize(LEGACY / "legacy_with_offsets.pt")  # no byte range: a blind pread fails
    whole = bytes(checkpoint.read_bytes(transposed))
    assert bytes(checkpoint.read_bytes(transposed, 12, 20)) == whole[12:32]


def test_shared_storages_are_one_record():
    checkpoint = qtool.open_checkpoint(LEGACY / "legacy_shared_storage.pt")
    tensors = checkpoint.tensors
    assert tensors["weight"].begin == tensors["tied"].begin == tensors["reshaped"].begin
    views = qtool.open_checkpoint(LEGACY / "legacy_uncloned_views.pt").tensors
    assert views["tensor2"].begin - views["tensor1"].begin == 40 * 4  # two windows of one 100-float storage


def test_legacy_quantized_tensors_decode_as_pytorch_does():
    inspection = qtool.inspect(LEGACY / "quantized_legacy.pt")
    state = torch.load(LEGACY / "quantized_legacy.pt", weights_only=True)
    labels = {w.name: w.scheme.label for w in inspection.weights}
    assert labels == {"per_tensor": "uint8 asym tensor", "per_channel": "int8 sym channel"}
    for weight in inspection.weights:
        out = decoder_for(weight).decode(inspection.checkpoint, weight, "cpu")
        assert torch.equal(out, state[weight.name].dequantize()), weight.name


def test_dequantize_of_a_legacy_file_writes_torchs_values(tmp_path):
    qtool.dequantize(LEGACY / "legacy_with_offsets.pt", tmp_path / "out.safetensors", dtype="f32")
    out = load_file(tmp_path / "out.safetensors")
    state = torch.load(LEGACY / "legacy_with_offsets.pt", weights_only=True)["model"]
    for name, tensor in state.items():
        if tensor.is_floating_point():
            assert torch.equal(out[name], tensor.float()), name


def test_inspect_stats_of_a_strided_view():
    result = runner.invoke(app, ["inspect", str(LEGACY / "legacy_with_offsets.pt"), "--stats", "--json"])
    assert result.exit_code == 0, result.output
    stats = {w["name"]: w.get("stats") for w in json.loads(result.stdout)["weights"]}
    state = torch.load(LEGACY / "legacy_with_offsets.pt", weights_only=True)["model"]
    assert stats["transposed"]["max"] == pytest.approx(float(state["transposed"].max()))
    assert stats["stepped"]["mean"] == pytest.approx(float(state["stepped"].double().mean()))


def test_nothing_is_imported_to_list_legacy_files():
    code = (
        "import sys, qtool\n"
        "for path in sys.argv[1:]:\n"
        "    qtool.inspect(path)\n"
        "assert 'torch' not in sys.modules and 'torchao' not in sys.modules\n"
    )
    paths = [str(p) for p in sorted(LEGACY.glob("legacy*.pt"))] + [str(LEGACY / "quantized_legacy.pt")]
    done = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# -- refusals ------------------------------------------------------------------------------------------


def test_a_torchscript_archive_is_named_from_its_listing():
    line = exit_2(LEGACY / "scripted.pt", "a TorchScript archive: qtool reads state dicts, not scripted modules")
    assert line.endswith("not scripted modules")


def test_a_plain_pickle_without_the_magic_number_is_refused(tmp_path):
    path = tmp_path / "plain.bin"
    import pickle

    path.write_bytes(pickle.dumps({"a": 1}, protocol=2))
    exit_2(path, "is a pickle, but not a PyTorch checkpoint")


def test_not_a_checkpoint_at_all(tmp_path):
    path = tmp_path / "text.bin"
    path.write_text("hello")
    exit_2(path, "is not a PyTorch checkpoint")


def test_a_truncated_legacy_file_is_refused(tmp_path):
    data = (LEGACY / "legacy_with_offsets.pt").read_bytes()
    for cut in (1, 20, 200, len(data) - 40, len(data) - 1):
        path = tmp_path / f"cut{cut}.pt"
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError):
            qtool.open_checkpoint(path)


# -- issue 10 regression files ------------------------------------------------------------------------


def test_a_zero_byte_zero_point_record_is_refused_before_any_read():
    exit_2(
        BAD / "zero_byte_zero_point.pt",
        "storage '6' is declared as 8 int64 elements (64 bytes), but its record holds 0 bytes",
    )


def test_a_record_too_small_for_its_view_is_refused(tmp_path):
    # a 4-float storage whose tensor claims shape (2, 3): 6 elements past its 16 bytes
    with zipfile.ZipFile(BAD / "laughs24.pt") as archive:
        pickle = archive.read("archive/data.pkl")
    pickle = pickle.replace(b"K\x00K\x04\x85K\x01\x85", b"K\x00K\x02K\x03\x86K\x03K\x01\x86", 1)
    write_zip(tmp_path / "short.pt", {"archive/data.pkl": pickle, "archive/data/0": struct.pack("<4f", 1, 2, 3, 4)})
    exit_2(
        tmp_path / "short.pt",
        "tensor 'weight' (float32 [2, 3], offset 0, strides [3, 1]) needs 24 bytes of storage '0', which holds 16",
    )


def test_a_bit_flipped_torchao_pickle_reads_or_fails_in_one_line():
    result = runner.invoke(app, ["inspect", str(BAD / "torchao_bitflip.pt"), "--json"])
    assert result.exit_code == 0, result.output  # "clock_size" is an attribute qtool doesn't know
    weights = {w["name"]: w for w in json.loads(result.stdout)["weights"]}
    assert weights["int8.weight"]["scheme"]["convention"] == "torchao"


@pytest.mark.parametrize("name", ["laughs24.pt", "laughs40.pt", "laughs_tensors.pt"])
def test_billion_laughs_walks_in_linear_time(name):
    start = time.perf_counter()
    checkpoint = qtool.open_checkpoint(BAD / name)
    assert time.perf_counter() - start < 2.0
    assert "weight" in checkpoint.tensors
    assert all(len(v) <= 200 for v in checkpoint.metadata.values())
    if name == "laughs_tensors.pt":
        assert checkpoint.tensors["laughs.0.0"].shape == (4,)
        assert checkpoint.metadata["laughs.1.0"] == "<the same object as laughs.0>"


def deflate_bomb(gigabytes: float) -> tuple[bytes, int]:
    """A raw deflate stream of a tiny pickle and then `gigabytes` GB of zeros, built from one
    repeated full-flush block (fast); and its inflated size."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = packer.compress(b"\x80\x02}q\x00.") + packer.flush(zlib.Z_FULL_FLUSH)
    block = packer.compress(bytes(16 << 20)) + packer.flush(zlib.Z_FULL_FLUSH)
    count = int(gigabytes * 1024 / 16)
    return head + block * count + packer.flush(), 6 + count * (16 << 20)


def write_zip(path: Path, members: dict[str, bytes], raw: dict[str, tuple[bytes, int, int]] | None = None) -> None:
    """A zip archive written by hand: STORED members, and `raw` members as (deflated bytes,
    declared size, declared crc), whatever they really inflate to."""
    out = bytearray()
    central = bytearray()
    entries = [(name, 0, data, len(data), zlib.crc32(data)) for name, data in members.items()]
    entries += [(name, 8, data, size, crc) for name, (data, size, crc) in (raw or {}).items()]
    for name, method, data, size, crc in entries:
        encoded = name.encode()
        offset = len(out)
        out += (
            struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, method, 0, 0, crc, len(data), size, len(encoded), 0)
            + encoded
            + data
        )
        central += (
            struct.pack(
                "<4sHHHHHHIIIHHHHHII",
                b"PK\x01\x02",
                20,
                20,
                0,
                method,
                0,
                0,
                crc,
                len(data),
                size,
                len(encoded),
                0,
                0,
                0,
                0,
                0,
                offset,
            )
            + encoded
        )
    cd_offset = len(out)
    out += central + struct.pack(
        "<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(central), cd_offset, 0
    )
    path.write_bytes(bytes(out))


@pytest.mark.parametrize("declared", ["honest", "lying"])
def test_a_zip_bomb_is_refused_quickly_in_little_memory(tmp_path, declared):
    stream, size = deflate_bomb(1.5)
    assert len(stream) < 2_000_000
    stated = size if declared == "honest" else 1000
    path = tmp_path / "bomb.pt"
    write_zip(path, {"archive/byteorder": b"little"}, {"archive/data.pkl": (stream, stated, 0)})
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(CheckpointError) as caught:
            qtool.open_checkpoint(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 2.0
    assert peak < 16 << 20
    expected = "over qtool's limit" if declared == "honest" else "inflates to a size other than the 1000 bytes"
    assert expected in str(caught.value)


def test_a_compressed_data_record_is_refused(tmp_path):
    with zipfile.ZipFile(BAD / "laughs24.pt") as archive:
        members = {info.filename: archive.read(info.filename) for info in archive.infolist()}
    data = members.pop("archive/data/0")
    packed = zlib.compressobj(6, zlib.DEFLATED, -15)
    stream = packed.compress(data) + packed.flush()
    write_zip(tmp_path / "deflated.pt", members, {"archive/data/0": (stream, len(data), zlib.crc32(data))})
    exit_2(tmp_path / "deflated.pt", "stores tensor data compressed (record data/0)")


def test_a_huge_central_directory_claim_is_refused(tmp_path):
    data = bytearray((BAD / "laughs24.pt").read_bytes())
    data[-10:-6] = struct.pack("<I", 0xFFFFFFF0)  # central directory size
    (tmp_path / "cd.pt").write_bytes(bytes(data))
    exit_2(tmp_path / "cd.pt", "cannot read the archive")


# -- the pickle interpreter on malformed input ----------------------------------------------------------


def hooks() -> TorchHooks:
    def storage_for(key, dtype, numel, view):
        return Storage(key, dtype, numel)

    return TorchHooks(storage_for)


EXPECTED = (PickleError, Refused)


def pickles() -> list[bytes]:
    found = []
    for path in (TORCH / "native.pt", TORCH / "dynamic.pth", BAD / "laughs_tensors.pt"):
        with zipfile.ZipFile(path) as archive:
            found.append(archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl"))))
    return found


def test_truncation_at_every_byte_is_a_pickle_error():
    for data in pickles():
        interpret(data, hooks())
        for cut in range(len(data)):
            with pytest.raises(PickleError):
                interpret(data[:cut], hooks())


def test_every_single_byte_change_is_data_or_a_pickle_error():
    data = pickles()[1]
    for position in range(len(data)):
        for value in (0x00, 0x28, 0x2E, 0x71, 0xFF, data[position] ^ 0x01):
            changed = data[:position] + bytes([value]) + data[position + 1 :]
            try:
                interpret(changed, hooks())
            except EXPECTED:
                pass


OPCODES = b"(.012FIJKLMNPQRSTUVXabcdeghijlopqrstu}])G\x80\x81\x85\x86\x87\x88\x89\x8a\x8b\x8c\x8d\x8e\x8f\x90\x91\x92\x93\x94\x95\x96BC"
_ARGS = st.one_of(
    st.binary(max_size=6),
    st.sampled_from(
        [
            b"torch\nFloatStorage\n",
            b"collections\nOrderedDict\n",
            b"torch._utils\n_rebuild_tensor_v2\n",
            b"0\n",
            b"\x01\x00\x00\x00",
            b"\xff\xff\xff\x7f",
        ]
    ),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(list(OPCODES)), _ARGS), max_size=60))
def test_opcode_soup_is_data_or_a_pickle_error(program):
    data = b"".join(bytes([op]) + arg for op, arg in program)
    try:
        interpret(data, hooks(), max_objects=10_000)
    except EXPECTED:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_data_or_a_pickle_error(data):
    try:
        interpret(data, hooks(), max_objects=10_000)
    except EXPECTED:
        pass


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_mutated_archive_is_exit_0_or_a_checkpoint_error(tmp_path_factory, data):
    """Flip bytes anywhere in a real archive (the CRC fixed where data.pkl changed): reading
    and decoding either works or raises CheckpointError."""
    source = TORCH / ("native.pt" if data.draw(st.booleans()) else "dynamic.pth")
    with zipfile.ZipFile(source) as archive:
        members = {info.filename: archive.read(info.filename) for info in archive.infolist()}
    name = data.draw(st.sampled_from(sorted(members)))
    body = bytearray(members[name])
    for _ in range(data.draw(st.integers(1, 4))):
        if body:
            body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()) and body:
        body = body[: data.draw(st.integers(0, len(body) - 1))]
    members[name] = bytes(body)
    path = tmp_path_factory.mktemp("mutated") / "m.pt"
    write_zip(path, members)
    try:
        inspection = qtool.inspect(path)
        for weight in inspection.weights:
            if weight.quantized:
                decoder_for(weight).decode(inspection.checkpoint, weight, "cpu")
            else:
                inspection.checkpoint.read_bytes(weight.data)
    except CheckpointError:
        pass


def test_dicts_keep_every_entry_unhashed():
    value, end = interpret(b"\x80\x02}(K\x01K\x02K\x01K\x03u.", hooks())
    assert isinstance(value, PDict) and value.items == [(1, 2), (1, 3)] and end == 14


def test_refused_globals_are_named():
    with pytest.raises(Refused, match="posix.system"):
        interpret(b"cposix\nsystem\n(X\x02\x00\x00\x00idtR.", hooks())
    with pytest.raises(Refused, match="torch.nn.modules.linear.Linear"):
        interpret(b"ctorch.nn.modules.linear\nLinear\n.", hooks())


def test_zip_directory_rejects_members_past_the_end(tmp_path):
    path = tmp_path / "z.zip"
    write_zip(path, {"a/data.pkl": b"\x80\x02}."})
    data = bytearray(path.read_bytes())
    data[18:22] = struct.pack("<I", 10_000)  # the local header's compressed size: unused
    at = data.rfind(b"PK\x01\x02")
    data[at + 20 : at + 24] = struct.pack("<I", 10_000)  # the directory's compressed size
    path.write_bytes(bytes(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ZipError):
            ZipDirectory(fd, os.path.getsize(path))
    finally:
        os.close(fd)


def test_a_big_endian_archive_reads_the_values_torch_does(tmp_path):
    """byteorder "big" (torch.save on a big-endian machine): every tensor is gathered and
    byte-swapped, and matches what torch.load makes of the same file."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    state = {
        "a": base,
        "b": torch.linspace(-2, 2, 5).to(torch.bfloat16),
        "c": base.t(),
        "d": torch.arange(6, dtype=torch.int64) * 1000003,
    }
    source = tmp_path / "little.pt"
    torch.save(state, source)
    widths = {"0": 4, "1": 2, "2": 8}  # storages in order of first use: a (and c), b, d

    def swap(name: str, data: bytes) -> bytes:
        if name.endswith("/byteorder"):
            return b"big"
        key = name.rpartition("/data/")[2] if "/data/" in name else None
        if key in widths:
            width = widths[key]
            return b"".join(data[i : i + width][::-1] for i in range(0, len(data), width))
        return data

    with zipfile.ZipFile(source) as archive:
        members = {info.filename: swap(info.filename, archive.read(info.filename)) for info in archive.infolist()}
    target = tmp_path / "big.pt"
    write_zip(target, members)
    expected = torch.load(target, weights_only=True)
    checkpoint = qtool.open_checkpoint(target)
    for name, tensor in state.items():
        assert torch.equal(expected[name], tensor)  # torch reads it as the original
        stored = checkpoint.tensors[name]
        assert not stored.in_file or stored.dtype.bits == 8
        assert torch.equal(checkpoint.load(stored), tensor), name


def test_sub_byte_quantized_tensors_decode_as_pytorch_does(tmp_path):
    x = torch.rand(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = torch.quantize_per_tensor(x, 0.1, 2, torch.quint4x2)
    torch.save({"q4": packed}, tmp_path / "q4.pt")
    inspection = qtool.inspect(tmp_path / "q4.pt")
    weight = inspection.weights[0]
    assert weight.scheme.label == "uint4 asym tensor" and weight.shape == (4, 8) and weight.data.shape == (16,)
    assert torch.equal(decoder_for(weight).decode(inspection.checkpoint, weight, "cpu"), packed.dequantize())


def test_truncation_of_a_legacy_file_at_every_byte_is_refused(tmp_path):
    data = (LEGACY / "simple_legacy.pt").read_bytes()
    path = tmp_path / "cut.pt"
    for cut in range(1, len(data)):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError):
            qtool.open_checkpoint(path)


def _many_tensors() -> dict:
    gen = torch.Generator().manual_seed(3)
    grid = torch.randn(6, 10, generator=gen)
    return {
        "f64": torch.randn(3, generator=gen, dtype=torch.float64),
        "i16": torch.arange(-4, 4, dtype=torch.int16),
        "u8": torch.arange(9, dtype=torch.uint8).reshape(3, 3),
        "u16": torch.arange(5, dtype=torch.int32).to(torch.uint16),
        "c64": torch.randn(2, 2, generator=gen, dtype=torch.complex64),
        "e4m3": torch.randn(4, 4, generator=gen).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(4, generator=gen).to(torch.float8_e5m2),
        "param": torch.nn.Parameter(torch.randn(2, 3, generator=gen)),
        "expanded": torch.randn(1, 4, generator=gen).expand(3, 4),  # stride 0
        "permuted": torch.randn(2, 3, 4, generator=gen).permute(2, 0, 1),
        "corner": grid[1:4, 2:7],
        "tied": grid,
        "scalar": torch.tensor(3, dtype=torch.int64),
        "list": [grid[0], grid[5]],
        "nested": {"deeper": {"x": torch.ones(2, dtype=torch.bool)}},
    }


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("protocol", [2, 4])
def test_many_dtypes_and_views_read_as_torch_load_reads_them(tmp_path, legacy, protocol):
    path = tmp_path / "many.pt"
    tensors = _many_tensors()
    if legacy:  # torch saves these on an UntypedStorage, which its own legacy loader can't read back
        tensors = {k: v for k, v in tensors.items() if k not in ("u16", "e4m3", "e5m2")}
    torch.save(tensors, path, _use_new_zipfile_serialization=not legacy, pickle_protocol=protocol)
    checkpoint = qtool.open_checkpoint(path)
    state = torch.load(
        path, weights_only=protocol == 2
    )  # torch's weights-only unpickler has no FRAME (protocol 4); our own file
    reference = flatten(state)
    reference.update({f"list.{i}": t for i, t in enumerate(state["list"])})
    assert set(checkpoint.tensors) == set(reference)
    for name, expected in reference.items():
        stored = checkpoint.tensors[name]
        got = checkpoint.load(stored)
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), expected.contiguous().reshape(-1).view(torch.uint8)), name


def test_a_legacy_file_saved_from_a_gpu_reads_on_the_cpu(tmp_path):
    """Before 1.6, CUDA tensors were pickled with torch.cuda.<Name>Storage and location "cuda:0"."""
    data = (LEGACY / "simple_legacy.pt").read_bytes()
    gpu = data.replace(b"ctorch\nFloatStorage\n", b"ctorch.cuda\nFloatStorage\n").replace(
        b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0"
    )
    assert gpu != data
    (tmp_path / "gpu.pt").write_bytes(gpu)
    expected = torch.load(LEGACY / "simple_legacy.pt", weights_only=True)
    checkpoint = qtool.open_checkpoint(tmp_path / "gpu.pt")
    for name, tensor in expected.items():
        assert torch.equal(checkpoint.load(checkpoint.tensors[name]), tensor), name
