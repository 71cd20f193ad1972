"""qtool.native.transcode_gguf (a requantize's rows decoded as they are encoded) against what it
stands in for: decode_gguf of the whole weight to float32, then encode_gguf. The same bytes and
the same error sums, for every source type the decoder has and every target the encoder has,
with and without importance weights, on one thread and two; rows holding inf or NaN too. And
the executor: a GGUF requantize takes this path, and writes what the full decode wrote."""

from __future__ import annotations

import os

import numpy as np
import pytest

from qtool import native
from qtool.errors import KernelError
from qtool.ggml_types import LLAMA_CPP, ggml_type_named

if os.environ.get("QTOOL_REQUIRE_NATIVE") == "1":  # CI: a silently skipped build must fail
    assert native.available(), "qtool.native._kernels was not built (setup.py) or QTOOL_NATIVE=0"
pytestmark = pytest.mark.skipif(not native.available(), reason="qtool.native._kernels is not built")

SOURCES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
TARGETS = ["Q8_0", "Q4_0", "Q4_1", "Q5_1", "Q4_K", "Q6_K", "IQ4_NL"]
ROWS, COLS = 40, 512  # 40 rows: split over two threads (16 rows a part at least)


def blocks_of(type_name: str, values: np.ndarray) -> bytes:
    rows, cols = values.shape
    return bytes(
        native.encode_gguf(
            type_name, memoryview(np.ascontiguousarray(values, np.float32)).cast("B"), "F32", rows, cols
        ).data
    )


def source_blocks(type_name: str, seed: int = 0) -> bytes:
    values = np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
    values[1, :64] = 0.0  # an all-zero run: zero scales
    return blocks_of(type_name, values)


def decoded_then_encoded(target: str, source: str, raw: bytes, rows: int, cols: int, importance=None):
    block = 256 if source.endswith("_K") or source == "IQ4_XS" else 32
    values = native.decode_gguf(source, raw, rows * cols // block, block, "F32")
    return native.encode_gguf(target, values, "F32", rows, cols, importance)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = native.threads()
    native.set_threads(request.param)
    yield request.param
    native.set_threads(before)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("target", TARGETS)
def test_transcode_is_decode_then_encode(source, target, threads):
    raw = source_blocks(source)
    want = decoded_then_encoded(target, source, raw, ROWS, COLS)
    got = native.transcode_gguf(target, source, raw, ROWS, COLS)
    assert bytes(got.data) == bytes(want.data)
    assert got.errors == want.errors and got.errors is not None


@pytest.mark.parametrize("target", ["Q8_0", "Q4_1", "Q4_K", "IQ4_XS"])
def test_transcode_with_importance_weights(target, threads):
    raw = source_blocks("Q4_1", seed=3)
    importance = np.random.default_rng(4).uniform(0.1, 10.0, COLS).astype("<f4").tobytes()
    want = decoded_then_encoded(target, "Q4_1", raw, ROWS, COLS, importance)
    got = native.transcode_gguf(target, "Q4_1", raw, ROWS, COLS, importance)
    assert bytes(got.data) == bytes(want.data) and got.errors == want.errors


@pytest.mark.parametrize("target", ["Q8_0", "Q4_K"])
def test_rows_holding_inf_or_nan_say_so_as_encode_does(target):
    """A Q4_1 block whose float16 scale is inf decodes to inf and NaN: no error sums, and for
    the K-quants (complete) the same bytes as encoding the decoded values."""
    raw = bytearray(source_blocks("Q4_1", seed=5))
    raw[20 * (COLS // 32) * 7 : 20 * (COLS // 32) * 7 + 2] = np.float16(np.inf).tobytes()  # row 7, first block's d
    want = decoded_then_encoded(target, "Q4_1", bytes(raw), ROWS, COLS)
    got = native.transcode_gguf(target, "Q4_1", bytes(raw), ROWS, COLS)
    assert got.errors is None and want.errors is None
    if ggml_type_named(target).quantizer == LLAMA_CPP:  # the K-quants write these rows too
        assert bytes(got.data) == bytes(want.data)


def test_bad_sizes_are_kernel_errors_before_any_allocation():
    raw = source_blocks("Q4_1")
    with pytest.raises(KernelError, match="holds"):
        native.transcode_gguf("Q8_0", "Q4_1", raw[:-1], ROWS, COLS)
    with pytest.raises(KernelError, match="multiple"):
        native.transcode_gguf("Q4_K", "Q4_1", raw, ROWS * COLS // 160, 160)  # whole Q4_1 blocks, not whole Q4_K ones
    with pytest.raises(KernelError, match="no native GGUF transcoder"):
        native.transcode_gguf("Q8_0", "F16", raw, ROWS, COLS)
    assert native.can_transcode("Q4_1", "Q8_0") and not native.can_transcode("F16", "Q8_0")


# -- the executor ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q4_1_gguf(tmp_path_factory):
    """A small llama GGUF whose weights are all Q4_1 (norms F32), as qtool writes it."""
    from typer.testing import CliRunner

    from qtool.cli import app
    from tests.test_gguf_requantize import REF, SMALL

    folder = tmp_path_factory.mktemp("transcode")
    f16, q4_1 = folder / "small-f16.gguf", folder / "small-q4_1.gguf"
    REF.write_model(str(f16), dict(SMALL, hidden=512, ffn=1024), seed=11)
    result = CliRunner().invoke(app, ["quantize", str(f16), "-o", str(q4_1), "--scheme", "q4_1", "-q"])
    assert result.exit_code == 0, result.output
    return q4_1


def _requantize(source, out, scheme: str):
    import json

    from typer.testing import CliRunner

    from qtool.cli import app

    result = CliRunner().invoke(
        app,
        ["quantize", str(source), "-o", str(out), "--scheme", scheme, "--allow-requantize", "--threads", "2", "--json"],
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    return out.read_bytes(), document["summary"], {w["name"]: w.get("sqnr_db") for w in document["weights"]}


@pytest.mark.parametrize("scheme", ["Q8_0", "Q4_K_M", "q5_1"])
def test_a_gguf_requantize_transcodes_and_writes_what_the_full_decode_wrote(q4_1_gguf, tmp_path, monkeypatch, scheme):
    from qtool.encoders.ggml_blocks import GgmlBlockEncoder

    calls = []
    transcode = native.transcode_gguf
    monkeypatch.setattr(native, "transcode_gguf", lambda *args, **kw: calls.append(args[:2]) or transcode(*args, **kw))
    fast = _requantize(q4_1_gguf, tmp_path / "fast.gguf", scheme)
    assert calls and all(source == "Q4_1" for _, source in calls)
    monkeypatch.setattr(GgmlBlockEncoder, "transcodes", lambda self, weight: False)
    calls.clear()
    slow = _requantize(q4_1_gguf, tmp_path / "slow.gguf", scheme)
    assert not calls
    assert fast[0] == slow[0]  # the whole file, byte for byte
    assert fast[1]["sqnr_db"] == slow[1]["sqnr_db"] and fast[2] == slow[2]
