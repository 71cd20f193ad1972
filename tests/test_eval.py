"""`qtool eval` and `compare --text` on tiny random-weight models of each family that
transformers builds from its own configs: the perplexity equals transformers' own whole-model
forward on the same windows and scored positions; a model against itself gives KL 0 and top-1
agreement 1; a quantized model evaluates as transformers' decompressed copy of it; a change to
one layer shows in that layer's hidden-state error and not before; passes over the windows
change nothing; bad input is one line and exit 2, a breached gate exit 1."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qtool import api  # noqa: E402
from qtool.evaluation.report import OutputGates  # noqa: E402
from tests.test_calibration_moe import tiny_moe  # noqa: E402
from tests.test_calibration_runner import FAMILIES, TEXT, TINY, tiny_model  # noqa: E402

CTX, WINDOWS = 32, 3


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT * 2)
    return path


def transformers_perplexity(folder, text, ctx: int = CTX, windows: int = WINDOWS) -> tuple[float, int | None]:
    """llama-perplexity's scoring done by hand on transformers' own float32 model: (perplexity, bos)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    special = tokenizer("a")["input_ids"]
    bos = tokenizer.bos_token_id if len(special) > len(plain) else None
    ids = ([bos] if bos is not None else []) + tokenizer(text.read_text(), add_special_tokens=False)["input_ids"]
    losses = []
    for window in range(windows):
        tokens = torch.tensor(ids[window * ctx : (window + 1) * ctx])
        if bos is not None:
            tokens[0] = bos
        with torch.no_grad():
            log_p = torch.log_softmax(model(tokens[None]).logits[0].double(), dim=-1)
        losses += [-float(log_p[j, tokens[j + 1]]) for j in range(ctx // 2, ctx - 1)]
    return math.exp(sum(losses) / len(losses)), bos


@pytest.mark.parametrize("family", [*FAMILIES, "mixtral", "qwen3_moe"])
def test_the_perplexity_is_transformers_whole_model_perplexity(tmp_path, family, text):
    folder = tmp_path / family
    folder.mkdir()
    if family in FAMILIES:
        tiny_model(folder, family, dtype=torch.float32)
    else:
        tiny_moe(folder, family, dtype=torch.float32)
    document = api.evaluate(folder, text, ctx=CTX, windows=WINDOWS)
    expected, bos = transformers_perplexity(folder, text)
    assert document["perplexity"] == pytest.approx(expected, rel=1e-5)
    assert document["bos"] == bos
    assert document["windows"] == WINDOWS and document["tokens_scored"] == WINDOWS * (CTX - 1 - CTX // 2)
    assert document["base"] is None and document["kld"] is None and document["top1_agreement"] is None
    assert all(layer["hidden_error"] is None for layer in document["layers"])


def test_a_model_against_itself_loses_nothing(text):
    document = api.evaluate(TINY, text, base=TINY, ctx=CTX, windows=WINDOWS)
    assert document["kld"]["mean"] == 0 and document["kld"]["max"] == 0
    assert document["top1_agreement"] == 1.0
    assert document["ppl_ratio"] == 1.0
    assert [layer["hidden_error"] for layer in document["layers"]] == [0.0] * len(document["layers"])
    assert sum(b["tokens"] for b in document["kld_histogram"]) == document["tokens_scored"]


def test_a_quantized_model_evaluates_as_transformers_decompressed_copy(tmp_path, text):
    pytest.importorskip("compressed_tensors")
    folder = tiny_model(tmp_path / "float", "llama", dtype=torch.float32)
    quantized = tmp_path / "w4"
    api.quantize(folder, quantized, scheme="int4:g32")
    document = api.evaluate(quantized, text, base=folder, ctx=CTX, windows=WINDOWS)
    expected, _ = transformers_perplexity(quantized, text)
    assert document["perplexity"] == pytest.approx(expected, rel=1e-5)
    assert document["base"]["perplexity"] == pytest.approx(transformers_perplexity(folder, text)[0], rel=1e-5)
    assert 0 < document["kld"]["mean"] < 0.1
    assert all(layer["hidden_error"] > 0 for layer in document["layers"])


def test_a_change_to_one_layer_shows_there_and_not_before(tmp_path, text):
    from safetensors.torch import load_file, save_file

    folder = tiny_model(tmp_path / "float", "llama", dtype=torch.float32)
    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    tensors = load_file(changed / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] *= 1.05
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    document = api.evaluate(changed, text, base=folder, ctx=CTX, windows=WINDOWS)
    errors = [layer["hidden_error"] for layer in document["layers"]]
    assert errors[0] == 0.0
    assert errors[1] > 1e-6
    assert document["kld"]["mean"] > 0


def test_passes_over_the_windows_change_nothing(text):
    from qtool.evaluation.evaluate import evaluate

    w4 = TINY.parent / "tiny-llama-w4a16"
    whole = evaluate(w4, text, base=TINY, ctx=CTX, windows=WINDOWS)
    steps = []
    parts = evaluate(
        w4,
        text,
        base=TINY,
        ctx=CTX,
        windows=WINDOWS,
        pass_bytes=1,
        on_start=lambda windows, ctx, count: steps.append(count),
    )
    layers = len(whole["layers"])
    assert steps == [WINDOWS * (layers + 1)]  # one window a pass: every layer read again each pass
    for key in ("perplexity", "kld", "top1_agreement"):
        assert parts[key] == pytest.approx(whole[key], rel=1e-9)
    assert [layer["hidden_error"] for layer in parts["layers"]] == pytest.approx(
        [layer["hidden_error"] for layer in whole["layers"]], rel=1e-9
    )


def test_the_gates(text):
    w4 = TINY.parent / "tiny-llama-w4a16"
    document = api.evaluate(w4, text, base=TINY, ctx=CTX, windows=WINDOWS, gates=OutputGates(min_top1=1.0))
    top1 = document["top1_agreement"]
    assert (document["violations"] == []) == (top1 >= 1.0)
    loose = api.evaluate(
        w4, text, base=TINY, ctx=CTX, windows=WINDOWS, gates=OutputGates(max_kld=10, min_top1=0, max_ppl_ratio=100)
    )
    assert loose["ok"] and loose["gates"] == {"max_kld": 10, "min_top1": 0, "max_ppl_ratio": 100}
    strict = api.evaluate(
        w4,
        text,
        base=TINY,
        ctx=CTX,
        windows=WINDOWS,
        gates=OutputGates(max_kld=0, max_ppl_ratio=document["ppl_ratio"] / 2),
    )
    assert len(strict["violations"]) == 2 and not strict["ok"]


# -- the command line ----------------------------------------------------------------------------


def qtool(*args):
    return subprocess.run([sys.executable, "-m", "qtool", *map(str, args)], capture_output=True, text=True, timeout=600)


def one_error_line(result, code: int = 2) -> str:
    assert result.returncode == code, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def test_the_cli_prints_the_document_and_exits_1_on_a_breached_gate(text):
    w4 = TINY.parent / "tiny-llama-w4a16"
    result = qtool("eval", w4, "--base", TINY, "--text", text, "--ctx", CTX, "--windows", WINDOWS, "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    for key in ("perplexity", "kld", "top1_agreement", "windows", "tokens_scored", "layers"):
        assert key in document
    assert document["base"]["perplexity"] > 0
    breached = qtool("eval", w4, "--base", TINY, "--text", text, "--ctx", CTX, "--windows", WINDOWS, "--max-kld", "0")
    assert "mean KL divergence" in one_error_line(breached, code=1)
    compared = qtool(
        "compare", TINY, w4, "--text", text, "--ctx", CTX, "--windows", WINDOWS, "--max-kld", "0", "--json"
    )
    assert compared.returncode == 1
    outputs = json.loads(compared.stdout)["outputs"]
    assert outputs["kld"]["mean"] == pytest.approx(document["kld"]["mean"], rel=1e-9)
    assert any("mean KL divergence" in v for v in json.loads(compared.stdout)["violations"])


def test_bad_input_is_one_line_and_exit_2(tmp_path, text):
    short = tmp_path / "short.txt"
    short.write_text("A few words.")
    assert "fewer than one window" in one_error_line(qtool("eval", TINY, "--text", short, "--ctx", 512))
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(TINY, no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    assert "no tokenizer" in one_error_line(qtool("eval", no_tokenizer, "--text", text, "--ctx", CTX))
    assert "base" in one_error_line(qtool("eval", TINY, "--text", text, "--ctx", CTX, "--max-kld", "1"))
    assert "no such text" in one_error_line(qtool("eval", TINY, "--text", tmp_path / "none.txt"))
    wider = tiny_model(tmp_path / "wider", "llama", dtype=torch.float32)
    config = json.loads((wider / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    from safetensors.torch import load_file, save_file

    tensors = {k: v for k, v in load_file(wider / "model.safetensors").items() if ".layers.1." not in k}
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(wider / name, other / name)
    assert "num_hidden_layers is 1 and 2" in one_error_line(
        qtool("eval", other, "--base", wider, "--text", text, "--ctx", CTX)
    )
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2}))
    save_file({"embeddings.word_embeddings.weight": torch.zeros(256, 64)}, bert / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, bert / name)
    one_error_line(qtool("eval", bert, "--text", text, "--ctx", CTX))


def test_tokenizers_that_disagree_are_named_at_the_first_difference(tmp_path, text):
    qwen = tiny_model(
        tmp_path / "qwen2", "qwen2", dtype=torch.float32
    )  # a byte-level tokenizer, tiny-llama's vocabulary size
    llama = tiny_model(tmp_path / "llama", "llama", dtype=torch.float32)
    line = one_error_line(qtool("eval", qwen, "--base", llama, "--text", text, "--ctx", CTX))
    assert "disagree on the text: token 0 is" in line


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_gguf_qtool_wrote_evaluates_as_the_hugging_face_model_it_came_from(tmp_path, family, text):
    pytest.importorskip("gguf")
    folder = tiny_model(tmp_path / family, family, dtype=torch.float32)
    gguf = tmp_path / "model.gguf"
    api.quantize(folder, gguf, scheme="q8_0")
    document = api.evaluate(gguf, text, base=folder, ctx=CTX, windows=WINDOWS)
    assert document["perplexity"] == pytest.approx(document["base"]["perplexity"], rel=1e-2)
    assert document["kld"]["mean"] < 1e-3 and document["top1_agreement"] > 0.9
    assert 0 < max(layer["hidden_error"] for layer in document["layers"]) < 1e-3  # Q8_0's error, q/k rows in order


def test_a_gguf_of_an_architecture_not_mapped_back_is_one_line(tmp_path, text):
    pytest.importorskip("gguf")
    from tests.test_gguf_model import edited, rewritten

    gguf = tmp_path / "model.gguf"
    api.quantize(TINY, gguf, scheme="q8_0")
    gemma = rewritten(gguf, tmp_path / "gemma.gguf", entries=edited("general.architecture", b"gemma2", "STRING"))
    line = one_error_line(qtool("eval", gemma, "--text", text, "--ctx", CTX))
    assert "a GGUF of architecture 'gemma2' is not mapped back" in line


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_lower_compute_dtype_gives_nearly_float32s_figures(text, dtype):
    w4 = TINY.parent / "tiny-llama-w4a16"
    exact = api.evaluate(w4, text, base=TINY, ctx=CTX, windows=WINDOWS)
    lower = api.evaluate(w4, text, base=TINY, ctx=CTX, windows=WINDOWS, dtype=dtype)
    assert lower["dtype"] == dtype
    assert lower["perplexity"] == pytest.approx(exact["perplexity"], rel=2e-2)
    assert lower["perplexity"] != exact["perplexity"]  # computed in the lower dtype, not float32
    assert "dtype 'float64' is not one of" in one_error_line(qtool("eval", TINY, "--text", text, "--dtype", "float64"))


def test_two_formats_of_one_model_compare(tmp_path, text):
    """A compressed-tensors model against a GGUF of the same model: the GGUF's tokenizer (from its
    vocabulary) and the folder's give the same tokens, and the two run in lockstep."""
    pytest.importorskip("gguf")
    pytest.importorskip("compressed_tensors")
    folder = tiny_model(tmp_path / "float", "llama", dtype=torch.float32)
    api.quantize(folder, tmp_path / "w4", scheme="int4:g32")
    api.quantize(folder, tmp_path / "q4_0.gguf", scheme="q4_0")
    document = api.evaluate(tmp_path / "q4_0.gguf", text, base=tmp_path / "w4", ctx=CTX, windows=WINDOWS)
    assert 0 < document["kld"]["mean"] < 0.05
    assert document["base"]["perplexity"] == pytest.approx(
        api.evaluate(tmp_path / "w4", text, ctx=CTX, windows=WINDOWS)["perplexity"], rel=1e-12
    )


@pytest.mark.parametrize(
    "candidate",
    [
        pytest.param(lambda tmp: TINY.parent / "tiny-llama-fp8", id="fp8"),
        pytest.param(
            lambda tmp: api.quantize(TINY, tmp / "nf4", scheme="nf4:g64") and tmp / "nf4", id="bitsandbytes-nf4"
        ),
        pytest.param(
            lambda tmp: api.quantize(TINY, tmp / "asym", scheme="int4:g64:asym") and tmp / "asym", id="int4-asym"
        ),
        pytest.param(
            lambda tmp: api.quantize(TINY, tmp / "q5_1.gguf", scheme="q5_1") and tmp / "q5_1.gguf", id="gguf-q5_1"
        ),
    ],
)
def test_every_format_qtool_writes_evaluates_against_its_original(tmp_path, text, candidate):
    """Each weight decoded by its own convention when its layer's turn comes: a small, nonzero
    loss against the original, growing along the depth from the first layer on."""
    path = candidate(tmp_path)
    document = api.evaluate(path, text, base=TINY, ctx=CTX, windows=WINDOWS)
    assert 0 < document["kld"]["mean"] < 0.05, document["kld"]
    assert all(0 < layer["hidden_error"] < 0.5 for layer in document["layers"])
