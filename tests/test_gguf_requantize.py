"""GGUF in, GGUF out: `qtool quantize model.gguf -o out.gguf --scheme Q4_K_M` keeps every
key-value (types included) and the tensor order, and writes what llama-quantize writes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from qtool import encoders
from qtool.cli import app
from qtool.layouts import gguf as gguf_layout
from qtool.llamacpp.mixes import MIXES, MixTensor, ModelFacts, choose_types
from tests.conftest import REPO

runner = CliRunner()
HERE = os.path.dirname(__file__)
LLAMA_QUANTIZE = os.environ.get("LLAMA_QUANTIZE", "/work/llama/build/bin/llama-quantize")
VOCAB = os.environ.get(
    "QTOOL_LLAMA_VOCAB", "/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf"
)
STAMPED = ("general.file_type", "general.quantization_version", "general.quantized_by")


def _reference_module():
    spec = importlib.util.spec_from_file_location(
        "make_reference", os.path.join(HERE, "fixtures", "gguf_mix", "make_reference.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REF = _reference_module()
SMALL = dict(layers=4, hidden=256, heads=4, kv=2, ffn=512, tied=False, dtype="F16")


def write_raw_gguf(path, entries, tensors) -> None:
    """A GGUF file of these key-values (every one, general.architecture included) and numpy
    tensors, written through qtool's header writer."""
    from qtool.formats.gguf_writer import gguf_header

    types = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
    header, ranges, size = gguf_header(entries, [(name, a.shape, types[a.dtype], a.nbytes) for name, a in tensors])
    with open(path, "wb") as handle:
        handle.write(header)
        for name, array in tensors:
            handle.seek(ranges[name][0])
            handle.write(array.tobytes())
        handle.truncate(size)


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def ok(*args):
    result = run(*args)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf-in") / "small-f16.gguf"
    REF.write_model(str(path), SMALL, seed=7)
    return path


def raw_value(field):
    """A field's value with strings as their bytes (gguf-py's contents() decodes them)."""
    kinds = field.types
    if kinds[0] == gguf.GGUFValueType.STRING or (len(kinds) > 1 and kinds[1] == gguf.GGUFValueType.STRING):
        values = [bytes(field.parts[i]) for i in field.data]
        return values if kinds[0] == gguf.GGUFValueType.ARRAY else values[0]
    return field.contents()


def fields_of(path) -> list[tuple[str, list[str], object]]:
    reader = gguf.GGUFReader(str(path))
    return [(key, [t.name for t in field.types], raw_value(field)) for key, field in list(reader.fields.items())[3:]]


def types_of(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def test_q8_0_mix_keeps_metadata_order_and_types(small_gguf, tmp_path):
    out = tmp_path / "small-q8_0.gguf"
    ok("quantize", small_gguf, "-o", out, "--scheme", "Q8_0", "-q")
    before, after = fields_of(small_gguf), fields_of(out)
    assert [f for f in after if f[0] not in STAMPED] == [f for f in before if f[0] not in STAMPED]
    stamped = {key: (kinds, value) for key, kinds, value in after if key in STAMPED}
    assert stamped["general.file_type"] == (["UINT32"], int(gguf.LlamaFileType.MOSTLY_Q8_0))
    assert stamped["general.quantization_version"] == (["UINT32"], gguf.GGML_QUANT_VERSION)
    assert stamped["general.quantized_by"][1].startswith(b"qtool ")
    reader_in, reader_out = gguf.GGUFReader(str(small_gguf)), gguf.GGUFReader(str(out))
    assert [t.name for t in reader_out.tensors] == [t.name for t in reader_in.tensors]
    types = types_of(out)
    assert types["token_embd.weight"] == types["output.weight"] == types["blk.0.attn_q.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32"


def test_lowercase_q8_0_is_one_type_on_qtools_selection_and_uppercase_is_llama_cpps_mix(small_gguf, tmp_path):
    ok("quantize", small_gguf, "-o", tmp_path / "lower.gguf", "--scheme", "q8_0", "-q")
    ok("quantize", small_gguf, "-o", tmp_path / "upper.gguf", "--scheme", "Q8_0", "-q")
    lower, upper = types_of(tmp_path / "lower.gguf"), types_of(tmp_path / "upper.gguf")
    assert lower["output.weight"] == "F16" and upper["output.weight"] == "Q8_0"  # qtool's default skips the LM head
    assert lower["blk.0.ffn_down.weight"] == upper["blk.0.ffn_down.weight"] == "Q8_0"


LLAMA_ARGS = {mix: ([], mix) for mix in MIXES if not MIXES[mix].imatrix} | {
    "Q3_K": (["--pure"], "Q3_K_M"),
    "Q4_K": (["--pure"], "Q4_K_M"),
    "Q5_K": (["--pure"], "Q5_K_M"),
}
# qtool's --pure on every file type is llama-quantize's --pure
LLAMA_ARGS |= {
    f"{mix} --pure": (["--pure"], mix) for mix, entry in MIXES.items() if not entry.pure and not entry.imatrix
}


def k_quant_encoders() -> bool:
    from qtool import native

    return native.available() and {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"} <= native.gguf_encode_types()


def encodable_anywhere(monkeypatch) -> None:
    """Plans as if every type had an encoder here, whatever this build has."""
    monkeypatch.setattr(encoders, "can_encode", lambda layout, job: True)


WIDE = dict(
    layers=3, hidden=320, heads=8, kv=2, ffn=544, tied=True, dtype="F32"
)  # fallbacks: 320 and 544 are not multiples of 256


ODD = dict(layers=2, hidden=272, heads=4, kv=4, ffn=544, tied=False, dtype="F32")  # 272 is not a multiple of 32: F16
BF16 = dict(layers=2, hidden=256, heads=4, kv=1, ffn=768, tied=True, dtype="BF16")


@pytest.fixture(scope="module")
def bf16_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf-in") / "bf16.gguf"
    REF.write_model(str(path), BF16, seed=10)
    return path


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf-in") / "wide-f32.gguf"
    REF.write_model(str(path), WIDE, seed=8)
    return path


@pytest.fixture(scope="module")
def odd_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf-in") / "odd-f32.gguf"
    REF.write_model(str(path), ODD, seed=9)
    return path


@pytest.mark.skipif(not os.path.exists(LLAMA_QUANTIZE), reason="llama-quantize not built (set LLAMA_QUANTIZE)")
@pytest.mark.parametrize("model", ["small", "wide", "odd", "bf16"])
@pytest.mark.parametrize("mix", list(LLAMA_ARGS))
def test_bytes_equal_llama_quantize(small_gguf, wide_gguf, odd_gguf, bf16_gguf, tmp_path, mix, model):
    """Every tensor's type and bytes, and every key-value, as llama-quantize writes them
    (llama-quantize writes tensors in its own order and moves general.file_type to the end)."""
    source = {"small": small_gguf, "wide": wide_gguf, "odd": odd_gguf, "bf16": bf16_gguf}[model]
    ours, theirs = tmp_path / "qtool.gguf", tmp_path / "llama.gguf"
    if not k_quant_encoders() and mix != "Q8_0":
        pytest.skip("needs qtool's K-quant encoders")
    name, _, pure = mix.partition(" ")
    ok("quantize", source, "-o", ours, "--scheme", name, *([pure] if pure else []), "-q")
    flags, ftype = LLAMA_ARGS[mix]
    done = subprocess.run([LLAMA_QUANTIZE, *flags, str(source), str(theirs), ftype, "1"], capture_output=True)
    assert done.returncode == 0, done.stderr[-2000:]
    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    by_name = {t.name: t for t in b.tensors}
    assert len(a.tensors) == len(b.tensors)
    for tensor in a.tensors:
        other = by_name[tensor.name]
        assert tensor.tensor_type == other.tensor_type, tensor.name
        assert bytes(tensor.data) == bytes(other.data), tensor.name
    ours_kv = {k: v for k, _, v in fields_of(ours) if k != "general.quantized_by"}
    assert ours_kv == {k: v for k, _, v in fields_of(theirs)}


def test_dry_run_shows_each_tensors_type_and_size(small_gguf, monkeypatch):
    encodable_anywhere(monkeypatch)
    document = json.loads(
        ok("quantize", small_gguf, "-o", "out.gguf", "--scheme", "Q4_K_M", "--dry-run", "--json").output
    )
    tensors = [MixTensor(n, tuple(s), d) for n, s, d in REF.tensors_of(SMALL)]
    expected = choose_types(MIXES["Q4_K_M"], tensors, ModelFacts("llama", SMALL["layers"], SMALL["heads"], SMALL["kv"]))
    assert [w["name"] for w in document["weights"]] == [t.name for t in tensors]  # file order
    for w in document["weights"]:
        dtype = w["tensors"][0]["dtype"]
        assert dtype == expected[w["name"]].type
        assert w["bytes_after"] == gguf_layout.gguf_layout_bytes(tuple(w["shape"]), dtype)
        assert w["stored_as"] in ("F16", "F32")
    assert document["summary"]["bytes_after"] == sum(w["bytes_after"] for w in document["weights"])
    assert document["metadata"]["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    human = ok("quantize", small_gguf, "-o", "out.gguf", "--scheme", "Q4_K_M", "--dry-run", "--format", "tsv").output
    assert "F16 -> Q6_K" in human and "output.weight" in human


def test_tensor_scheme_overrides_one_type_in_a_mix(small_gguf, monkeypatch):
    encodable_anywhere(monkeypatch)
    document = json.loads(
        ok(
            "quantize",
            small_gguf,
            "-o",
            "o.gguf",
            "--scheme",
            "Q4_K_M",
            "--tensor-scheme",
            "re:.*ffn_down.*=q8_0",
            "--dry-run",
            "--json",
        ).output
    )
    types = {w["name"]: w["tensors"][0]["dtype"] for w in document["weights"]}
    assert {types[f"blk.{i}.ffn_down.weight"] for i in range(SMALL["layers"])} == {"Q8_0"}
    assert types["output.weight"] == "Q6_K"
    result = run(
        "quantize", small_gguf, "-o", "o.gguf", "--scheme", "Q4_K_M", "--tensor-scheme", "re:.*=Q4_K_M", "--dry-run"
    )
    assert result.exit_code == 2 and "is a llama.cpp mix of types, not one type" in result.output


def test_requantize_copies_kept_quantized_tensors(small_gguf, tmp_path):
    q8 = tmp_path / "q8.gguf"
    ok("quantize", small_gguf, "-o", q8, "--scheme", "Q8_0", "-q")
    refused = run("quantize", q8, "-o", tmp_path / "x.gguf", "--scheme", "q4_0")
    assert refused.exit_code == 2 and "--allow-requantize" in refused.output
    out = tmp_path / "q4.gguf"
    ok("quantize", q8, "-o", out, "--scheme", "q4_0", "--allow-requantize", "-q")
    types = types_of(out)
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["output.weight"] == "Q8_0"
    a = {t.name: bytes(t.data) for t in gguf.GGUFReader(str(q8)).tensors}
    b = {t.name: bytes(t.data) for t in gguf.GGUFReader(str(out)).tensors}
    assert a["output.weight"] == b["output.weight"]


@pytest.mark.skipif(not os.path.exists(VOCAB), reason="llama.cpp's vocab GGUFs not here")
def test_every_key_of_a_real_vocab_gguf_survives(tmp_path):
    """llama.cpp's ggml-vocab-llama-spm.gguf's key-values (32000 tokens, scores, token types),
    plus an empty array and a custom alignment, in a tiny LLaMA with random weights."""
    vocab = gguf.GGUFReader(VOCAB)
    source = tmp_path / "tiny-vocab-f16.gguf"
    entries = []
    for key, field in list(vocab.fields.items())[3:]:
        kinds = field.types
        entries.append((key, field.contents(), kinds[0].name + (f":{kinds[1].name}" if len(kinds) > 1 else "")))
    entries.append(("qtool.test.empty", [], "ARRAY:INT16"))  # gguf-py refuses to write an empty array; GGUF allows it
    entries.append(("qtool.test.bytes", [b"ok", b"\xff\xfe not utf-8"], "ARRAY:STRING"))
    entries.append(("general.alignment", 64, "UINT32"))
    rng = np.random.default_rng(0)
    tensors = []
    for name, shape, dtype in REF.tensors_of(dict(SMALL, layers=1)):
        values = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        tensors.append((name, values if dtype == "F32" else values.astype(np.float16)))
    write_raw_gguf(source, entries, tensors)
    out = tmp_path / "tiny-vocab-q8_0.gguf"
    ok("quantize", source, "-o", out, "--scheme", "Q8_0", "-q")
    before, after = fields_of(source), fields_of(out)
    assert len(before) > 20 and any(key == "tokenizer.ggml.tokens" and len(value) == 32000 for key, _, value in before)
    assert [f for f in after if f[0] not in STAMPED] == [f for f in before if f[0] not in STAMPED]
    reader = gguf.GGUFReader(str(out))
    assert reader.alignment == 64 and all(t.data_offset % 64 == 0 for t in reader.tensors)
    empty = reader.fields["qtool.test.empty"]
    assert (
        int(empty.parts[-2][0]) == gguf.GGUFValueType.INT16 and int(empty.parts[-1][0]) == 0
    )  # element type of an empty array
    raw = reader.fields["qtool.test.bytes"]
    assert [bytes(raw.parts[i]) for i in raw.data] == [b"ok", b"\xff\xfe not utf-8"]  # strings byte for byte


@pytest.mark.parametrize(
    "key, value, vtype, sub, message",
    [
        (
            "x.nested",
            [[1, 2], [3]],
            gguf.GGUFValueType.ARRAY,
            gguf.GGUFValueType.ARRAY,
            "x.nested holds arrays of arrays",
        ),
        ("general.alignment", 48, gguf.GGUFValueType.UINT32, None, "general.alignment"),  # qtool's reader or the layout
    ],
)
def test_key_values_qtool_cannot_copy_are_refused_in_one_line(tmp_path, key, value, vtype, sub, message):
    source = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_key_value(key, value, vtype, sub)
    writer.add_tensor("blk.0.attn_q.weight", np.ones((64, 64), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run("quantize", source, "-o", tmp_path / "out.gguf", "--scheme", "Q8_0")
    assert result.exit_code == 2 and message in result.output and str(source) in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out.gguf").exists()


def test_a_real_subprocess_quantizes_or_refuses_in_one_line(small_gguf, tmp_path):
    out = tmp_path / "small-q4_k_m.gguf"
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run(
        [sys.executable, "-m", "qtool", "quantize", str(small_gguf), "-o", str(out), "--scheme", "Q4_K_M", "-q"],
        capture_output=True,
        text=True,
        env=env,
    )
    if k_quant_encoders():
        assert done.returncode == 0, done.stderr
        assert set(types_of(out).values()) == {"Q4_K", "Q6_K", "F32"}
    else:
        assert done.returncode == 2 and not out.exists()
        assert done.stderr.startswith("error: ") and "cannot encode Q" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("scheme", ["Q4_K", "q6_k", "Q4_K_M"])
def test_weights_holding_nan_or_inf_encode_as_llama_cpp_does(tmp_path, scheme):
    """K-quant rows with NaN or inf: gguf-py cannot encode them; the native encoder writes
    llama.cpp's bytes, and the run reports no SQNR rather than failing (it exited 70)."""
    from qtool import native

    if "Q4_K" not in native.gguf_encode_types():
        pytest.skip("native K-quant encoders not built")
    x = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
    x[3, 5], x[7, 9] = np.nan, np.inf
    source = tmp_path / "nan.gguf"
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.attn_q.weight", x)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    out = tmp_path / "out.gguf"
    result = ok("quantize", source, "-o", out, "--scheme", scheme, "--json")
    assert json.loads(result.stdout)["summary"]["sqnr_db"] is None
    gtype = "Q6_K" if scheme == "q6_k" else "Q4_K"
    (tensor,) = gguf.GGUFReader(str(out)).tensors
    assert tensor.tensor_type.name == gtype
    want = native.encode_gguf(gtype, memoryview(x).cast("B"), "F32", 256, 512)
    assert bytes(tensor.data) == bytes(want.data)


def test_key_values_read_as_gguf_py_reads_them_and_a_cut_file_is_one_error(small_gguf, tmp_path):
    """qtool's own key-value reader (what a requantize writes back) against gguf-py's, and every
    truncation of the header is a CheckpointError, nothing else."""
    from qtool.errors import CheckpointError
    from qtool.formats.gguf import read_gguf_key_values

    entries = read_gguf_key_values(str(small_gguf))
    assert [
        (key, kind.split(":")[-1] if kind.startswith("ARRAY") else kind, value) for key, value, kind in entries
    ] == [(key, types[-1], value) for key, types, value in fields_of(small_gguf)]
    raw = small_gguf.read_bytes()
    header_end = 24 + sum(8 + len(key.encode()) + 4 for key, _, _ in entries) + 64  # roughly past the key-values
    cut = tmp_path / "cut.gguf"
    for end in range(0, min(len(raw), header_end), 7):
        cut.write_bytes(raw[:end])
        with pytest.raises(CheckpointError):
            read_gguf_key_values(str(cut))
