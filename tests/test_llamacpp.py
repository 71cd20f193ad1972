"""qtool's GGUF runs in llama.cpp itself: loaded by llama-cpp-python's `Llama`, it tokenizes as
the model's tokenizer does, gives finite logits and generates tokens.

Marked `llamacpp` and skipped when `llama_cpp` does not import (it is a C++ build). To run it
without building llama-cpp-python's wheel, point its pure-Python package at a shared-library
build of the same llama.cpp (what the ggufhf report gives as commands):

    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DBUILD_SHARED_LIBS=ON ...
    cmake --build build --target llama-quantize          # libllama.so, libggml*.so in build/bin
    cp -r llama_cpp_python-0.3.36/llama_cpp py/ && ln -s build/bin/lib*.so py/llama_cpp/lib/
    pip install --target py diskcache
    PYTHONPATH=py:. python -m pytest tests/test_llamacpp.py -m llamacpp

The real vocabularies are llama.cpp's own test files (models/ggml-vocab-*.gguf, MIT, in the
llama-cpp-python sdist); LLAMA_CPP_VOCABS names their folder. Tests that need one skip without it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import qtool
from tests.conftest import SAMPLES

pytestmark = pytest.mark.llamacpp

VOCABS = Path(os.environ.get("LLAMA_CPP_VOCABS", "/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/models"))
TINY = SAMPLES / "tiny-llama"
SCHEMES = ["q8_0", "q4_0", "Q4_K_M"]


def llama_cpp():
    try:
        import llama_cpp as module
    except Exception as exc:
        pytest.skip(f"llama_cpp does not import: {exc}")
    return module


def vocab_file(name: str) -> Path:
    path = VOCABS / name
    if not path.is_file():
        pytest.skip(f"{path} is not here (set LLAMA_CPP_VOCABS to llama.cpp's models/ folder)")
    return path


def load(path: Path):
    return llama_cpp().Llama(str(path), n_ctx=128, n_threads=1, n_batch=64, logits_all=True, verbose=False, seed=0)


def assert_runs(llm, prompt: bytes) -> list[int]:
    """Finite logits for the prompt, and 8 generated tokens."""
    tokens = llm.tokenize(prompt, add_bos=True)
    llm.eval(tokens)
    assert np.isfinite(llm.scores[llm.n_tokens - 1]).all()
    llm.reset()
    generated = []
    for token in llm.generate(tokens, temp=0.0):
        generated.append(token)
        if len(generated) == 8:
            break
    assert len(generated) == 8 and all(0 <= t < llm.n_vocab() for t in generated)
    return generated


# -- from safetensors (qtool.llamacpp.model) -------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_sample_tiny_llama_runs_in_llama_cpp(tmp_path, scheme):
    from tokenizers import Tokenizer

    llama_cpp()
    out = tmp_path / "tiny.gguf"
    qtool.quantize(TINY, out, scheme)
    llm = load(out)
    text = "Hello wörld, 🦙!"
    assert (
        llm.tokenize(text.encode(), add_bos=True) == Tokenizer.from_file(str(TINY / "tokenizer.json")).encode(text).ids
    )
    assert_runs(llm, b"Hello")


def random_llama(folder: Path, tokenizer_from: Path, vocab_size: int, bos: int, eos: int) -> Path:
    """A one-layer LLaMA with random F16 weights, 64 wide, and the tokenizer files of `tokenizer_from`."""
    from safetensors.numpy import save_file

    hidden, heads, kv_heads, ffn = 64, 2, 1, 128
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(shape)).astype(np.float16)

    p = "model.layers.0"
    tensors = {
        "model.embed_tokens.weight": weight(vocab_size, hidden),
        f"{p}.self_attn.q_proj.weight": weight(hidden, hidden), f"{p}.self_attn.k_proj.weight": weight(32 * kv_heads, hidden),
        f"{p}.self_attn.v_proj.weight": weight(32 * kv_heads, hidden), f"{p}.self_attn.o_proj.weight": weight(hidden, hidden),
        f"{p}.mlp.gate_proj.weight": weight(ffn, hidden), f"{p}.mlp.up_proj.weight": weight(ffn, hidden), f"{p}.mlp.down_proj.weight": weight(hidden, ffn),
        f"{p}.input_layernorm.weight": np.ones(hidden, np.float16), f"{p}.post_attention_layernorm.weight": np.ones(hidden, np.float16),
        "model.norm.weight": np.ones(hidden, np.float16), "lm_head.weight": weight(vocab_size, hidden),
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab_size, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "bos_token_id": bos, "eos_token_id": eos, "tie_word_embeddings": False,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


def hf_tokenizer_from_vocab(vocab: Path, folder: Path, bos: tuple[str, int] | None = None) -> Path:
    """llama.cpp's vocab GGUF as a Hugging Face tokenizer folder, by transformers' GGUF reader,
    less the tokens that reader adds beyond the vocabulary (an `<|endoftext|>` for LLaMA 3),
    and with the BOS the real tokenizer.json's post-processor adds (LLaMA 3's does; the GGUF
    reader leaves it out, and the token ids that name the pre-tokenizer then change)."""
    import gguf
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(vocab.parent), gguf_file=vocab.name).save_pretrained(str(folder))
    count = len(gguf.GGUFReader(str(vocab)).fields["tokenizer.ggml.tokens"].data)
    tokenizer = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer["added_tokens"] = [token for token in tokenizer["added_tokens"] if token["id"] < count]
    if bos is not None:
        text, index = bos
        first = {"SpecialToken": {"id": text, "type_id": 0}}
        tokenizer["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                first,
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": text, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {text: {"id": text, "ids": [index], "tokens": [text]}},
        }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    return folder


def vocab_cases(vocab: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's own tokenizer test cases: texts (.inp) and the ids the real tokenizer gives (.out)."""
    texts = Path(f"{vocab}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    ids = [
        [int(t) for t in line.split()]
        for line in Path(f"{vocab}.out").read_text(encoding="utf-8").split("\n")[: len(texts)]
    ]
    assert len(texts) == len(ids) > 20
    return list(zip(texts, ids))


def test_llama3_bpe_tokenizer_runs_and_tokenizes_as_the_real_one(tmp_path):
    """A LLaMA 3 tokenizer (byte-level BPE, 128256 tokens): qtool names its pre-tokenizer and
    writes its merges, so llama.cpp splits llama.cpp's own test texts into the reference ids."""
    llama_cpp()
    vocab = vocab_file("ggml-vocab-llama-bpe.gguf")
    tokenizer = hf_tokenizer_from_vocab(vocab, tmp_path / "tok", bos=("<|begin_of_text|>", 128000))
    folder = random_llama(tmp_path / "model", tokenizer, 128256, 128000, 128001)
    out = tmp_path / "llama3.gguf"
    qtool.quantize(folder, out, "q8_0")
    import gguf

    pre = gguf.GGUFReader(str(out)).fields["tokenizer.ggml.pre"].contents()
    assert pre == "llama-bpe"  # without the BOS the hash is Smaug's, whose pre-tokenizer splits differently
    llm = load(out)
    for text, want in vocab_cases(vocab):
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == want, text
    assert_runs(llm, b"Hello world")


def test_llama2_spm_tokenizer_json_runs(tmp_path):
    """LLaMA 2's 32000-token tokenizer as tokenizer.json (BPE with byte fallback), through the
    LlamaHfVocab path."""
    llama_cpp()
    vocab = vocab_file("ggml-vocab-llama-spm.gguf")
    folder = random_llama(tmp_path / "model", hf_tokenizer_from_vocab(vocab, tmp_path / "tok"), 32000, 1, 2)
    out = tmp_path / "llama2.gguf"
    qtool.quantize(folder, out, "q4_0")
    llm = load(out)
    assert llm.tokenize(b"<0x41>", add_bos=False, special=False) != []
    assert llm.token_bos() == 1 and llm.token_eos() == 2
    assert_runs(llm, b"The capital of France is")


def test_sentencepiece_tokenizer_model_runs_and_tokenizes_as_sentencepiece(tmp_path):
    """A tokenizer.model (sentencepiece BPE with byte fallback, trained here on the README):
    its pieces and real scores, so llama.cpp's SPM tokenizer splits text as sentencepiece does."""
    llama_cpp()
    spm = pytest.importorskip("sentencepiece")
    import io

    from tests.conftest import REPO

    lines = [line for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=512, model_type="bpe", byte_fallback=True,
        character_coverage=0.995, num_threads=1, minloglevel=2, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,  # as LLaMA's: llama.cpp does not normalize
    )  # fmt: skip
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.model").write_bytes(model.getvalue())
    (tokenizer / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True})
    )
    folder = random_llama(tmp_path / "model", tokenizer, 512, 1, 2)
    out = tmp_path / "spm.gguf"
    qtool.quantize(folder, out, "q4_0")
    import gguf

    fields = gguf.GGUFReader(str(out)).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert len(set(fields["tokenizer.ggml.scores"].contents())) > 100  # sentencepiece's own scores, not one placeholder
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    llm = load(out)
    for text in (
        "Hello world",
        "qtool quantize model/ -o model-q4_0.gguf --scheme q4_0",
        "Ünïcödé 🦙 3.14159",
        lines[3],
        lines[-1],
    ):
        assert llm.tokenize(text.encode(), add_bos=True) == [1] + processor.encode(text), text
    assert_runs(llm, b"qtool inspect")


# -- from GGUF (requantize, keeping the input's metadata: the ggufmix branch) -----------------------


def tiny_llama_gguf(path: Path, vocab: Path) -> Path:
    """A two-layer LLaMA-shaped F16 GGUF, every width a multiple of 256, random weights, and
    the tokenizer keys of llama.cpp's vocab GGUF copied over as they are."""
    import gguf

    reader = gguf.GGUFReader(str(vocab))
    tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    hidden, heads, kv_heads, ffn, layers = 256, 4, 2, 512, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(
                name, field.contents(), kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            )
    rng = np.random.default_rng(1)

    def add(name: str, *shape: int) -> None:
        data = np.ones(shape, np.float32) if len(shape) == 1 else (0.02 * rng.standard_normal(shape)).astype(np.float16)
        writer.add_tensor(name, data)

    add("token_embd.weight", tokens, hidden)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", hidden, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * hidden // heads, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * hidden // heads, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    add("output_norm.weight", hidden)
    add("output.weight", tokens, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("scheme", SCHEMES)
def test_requantized_gguf_runs_in_llama_cpp(tmp_path, scheme):
    llama_cpp()
    vocab = vocab_file("ggml-vocab-llama-spm.gguf")
    source = tiny_llama_gguf(tmp_path / "in-f16.gguf", vocab)
    assert_runs(load(source), b"Hello")  # the input itself runs
    out = tmp_path / "out.gguf"
    qtool.quantize(source, out, scheme)
    llm = load(out)
    assert llm.tokenize(b"Hello world", add_bos=True) == load(source).tokenize(b"Hello world", add_bos=True)
    assert_runs(llm, b"Hello")


# -- quantized with an importance matrix (issue 21) ------------------------------------------------

IMATRIX_MIXES = [
    "Q4_K_M",
    "Q3_K_M",
    "Q2_K",
    "Q4_0",
    "IQ4_XS",
    "IQ3_S",
    "IQ3_M",
    "IQ3_XXS",
    "IQ2_M",
    "IQ2_S",
    "IQ2_XS",
    "IQ2_XXS",
]


@pytest.fixture(scope="module")
def imatrices(tmp_path_factory) -> dict[str, Path]:
    """tiny-llama's importance matrix as llama-imatrix made it (the fixture) and as `qtool
    imatrix` makes it on 4 chunks of 128 tokens of pydoc's topics."""
    from pydoc_data import topics

    from qtool import api
    from tests.imatrix_files import TINY_GGUF

    folder = tmp_path_factory.mktemp("imatrix")
    text = folder / "topics.txt"
    text.write_text("\n\n".join(topics.topics[key] for key in sorted(topics.topics))[:60000])
    ours = folder / "qtool-imatrix.gguf"
    api.imatrix(TINY, ours, text, chunks=4, chunk_size=128)
    return {"llama-imatrix": TINY_GGUF, "qtool imatrix": ours}


@pytest.mark.parametrize("made_by", ["llama-imatrix", "qtool imatrix"])
@pytest.mark.parametrize("mix", IMATRIX_MIXES)
def test_imatrix_quantized_gguf_runs_in_llama_cpp(tmp_path, imatrices, made_by, mix):
    import gguf

    llama_cpp()
    out = tmp_path / "out.gguf"
    qtool.quantize(TINY, out, mix, imatrix=imatrices[made_by])
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types - {"F32", "F16", "BF16"}, types  # something was quantized
    assert_runs(load(out), b"Hello")


@pytest.mark.parametrize("byte_fallback", [False, True])
def test_smollm2s_byte_level_tokenizer_runs_and_tokenizes_real_text_as_transformers(tmp_path, byte_fallback):
    """SmolLM2's real byte-level BPE tokenizer (with `byte_fallback: true`, as a folder had it,
    once written as a "llama" vocabulary without byte tokens: llama.cpp aborted in
    byte_to_token) tokenizes English prose as transformers does, and the model runs."""
    from transformers import AutoTokenizer

    from tests.test_gguf_hf import smollm2_tokenizer_folder

    llama_cpp()
    folder = smollm2_tokenizer_folder(tmp_path, byte_fallback=byte_fallback)
    out = tmp_path / "smollm2.gguf"
    qtool.quantize(folder, out, "q8_0")
    llm = load(out)
    text = (tmp_path / "english.txt").read_text(encoding="utf-8")
    want = AutoTokenizer.from_pretrained(str(folder)).encode(text, add_special_tokens=False)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == want
    assert_runs(llm, text[:200].encode())
