"""A GGUF read as the Hugging Face model it came from (qtool.evaluation.gguf_model): its weights
decode under their Hugging Face names to the original tensors, q/k rows back in Hugging Face's
order; its config.json and tokenizer are what transformers makes of the same file; and a hostile
file is one error line."""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import qtool
from qtool.conventions import decoder_for, resolve
from qtool.errors import CheckpointError, UsageError
from qtool.evaluation.gguf_model import gguf_as_hugging_face
from qtool.formats.gguf import read_gguf_key_values
from qtool.formats.gguf_writer import gguf_header
from qtool.formats.loader import open_checkpoint
from tests.conftest import SAMPLES

TINY = SAMPLES / "tiny-llama"
# what the view's config.json must say as the original config.json said it
CONFIG_FIELDS = (
    "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "vocab_size",
    "tie_word_embeddings", "bos_token_id", "eos_token_id",
)  # fmt: skip


def float32(value: float) -> float:
    """`value` as GGUF stores a FLOAT32 key, read back."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def exact_in_q8_0(shape: list[int], rng: np.random.Generator) -> np.ndarray:
    """Float32 integers from -127 to 127 whose every block of 32 holds a 127: Q8_0's scale is
    then exactly 1, so the GGUF stores them without error and a decode must give them back bit
    for bit. 1-D tensors (norms) are kept as floats: eighths, exact in any float type."""
    if len(shape) == 1:
        return (rng.integers(1, 64, size=shape) / 8).astype(np.float32)
    values = rng.integers(-127, 128, size=shape).astype(np.float32)
    values.reshape(-1, 32)[:, 0] = 127
    return values


def with_exact_weights(folder: Path) -> dict[str, np.ndarray]:
    """Replace the folder's model.safetensors by `exact_in_q8_0` tensors of the same names and
    shapes; returns them."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(folder / "model.safetensors"), "np") as handle:
        shapes = {name: handle.get_slice(name).get_shape() for name in handle.keys()}
    rng = np.random.default_rng(38)
    tensors = {name: exact_in_q8_0(shape, rng) for name, shape in shapes.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def tiny_llama(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    folder = tmp_path / "llama"
    folder.mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder / name)
    return folder, with_exact_weights(folder)


def tiny_qwen2(tmp_path: Path, monkeypatch) -> tuple[Path, dict[str, np.ndarray]]:
    """test_gguf_hf's one-layer Qwen2 (biases, a byte-level BPE), its pre-tokenizer named qwen2."""
    import hashlib

    from qtool.llamacpp import tokenizer as gguf_tokenizer
    from tests.test_gguf_hf import tiny_qwen2 as make

    folder, tokenizer = make(tmp_path)
    digest = hashlib.sha256(str(tokenizer.encode(gguf_tokenizer._PRE_TOKENIZER_TEXT).ids).encode()).hexdigest()
    monkeypatch.setitem(gguf_tokenizer.BPE_PRE_TOKENIZERS, digest, "qwen2")
    return folder, with_exact_weights(folder)


def decoded(view) -> dict[str, np.ndarray]:
    """Every weight of the view decoded by qtool's readers, q/k rows put back."""
    out = {}
    for weight in resolve(view.checkpoint):
        if weight.quantized:
            values = decoder_for(weight).decode(view.checkpoint, weight, "cpu").float()
        else:
            values = view.checkpoint.load(weight.data).float()
        rows = view.rows_back.get(weight.name)
        if rows is not None:
            values = rows.apply(values, values.shape[0])
        out[weight.name] = values.numpy()
    return out


# -- a GGUF written by qtool from a Hugging Face model reads back as that model ---------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_gguf_reads_back_as_the_hugging_face_model_it_was_written_from(tmp_path, monkeypatch, family):
    folder, original = tiny_llama(tmp_path) if family == "llama" else tiny_qwen2(tmp_path, monkeypatch)
    gguf_file = tmp_path / "model.gguf"
    qtool.quantize(folder, gguf_file, "q8_0")
    checkpoint = open_checkpoint(gguf_file)
    view = gguf_as_hugging_face(checkpoint)

    assert "blk.0.attn_q.weight" in checkpoint.tensors  # the original is left as it was
    assert set(view.checkpoint.tensors) == set(original)
    assert all(name == stored.name for name, stored in view.checkpoint.tensors.items())
    weights = decoded(view)
    assert any(w.quantized for w in resolve(view.checkpoint))
    for name, want in original.items():
        assert np.array_equal(weights[name], want), name

    permuted = {name for name in original if ".q_proj.weight" in name or ".k_proj.weight" in name}
    if family == "llama":  # the GGUF holds them in llama.cpp's rotary order: without rows_back they differ
        assert set(view.rows_back) == permuted
        assert view.rows_back["model.layers.0.self_attn.k_proj.weight"].heads == 2
        weight = next(w for w in resolve(view.checkpoint) if w.name in permuted and w.quantized)
        as_stored = decoder_for(weight).decode(view.checkpoint, weight, "cpu").numpy()
        assert not np.array_equal(as_stored, original[weight.name])
    else:
        assert view.rows_back == {}

    config, want = view.checkpoint.config, json.loads((folder / "config.json").read_text())
    for name in CONFIG_FIELDS:
        if name in want:
            expected = float32(want[name]) if name == "rms_norm_eps" else want[name]
            assert config[name] == expected, name
    assert config["num_key_value_heads"] == want["num_key_value_heads"]

    from transformers import AutoModelForCausalLM

    ids = torch.arange(0, 96).unsqueeze(0) * 7 % config["vocab_size"]
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert_same_logits(view, weights, reference, ids)


def assert_same_logits(view, weights: dict[str, np.ndarray], reference, ids) -> None:
    """transformers' model built from the view's config.json, holding the view's decoded
    weights, gives `reference`'s logits on `ids`: the config describes the model the weights
    came from (head width, rotary base, epsilon, tied head), not just its shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(view.checkpoint.config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields)).float()
    missing = model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False).missing_keys
    assert missing == (["lm_head.weight"] if view.checkpoint.config["tie_word_embeddings"] else [])
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("family", ["llama", "llama, no add_bos_token key", "qwen2"])
def test_the_tokenizer_is_transformers_own_reading_of_the_gguf(tmp_path, monkeypatch, family):
    """The tokenizer built from qtool's reading of the vocabulary gives the ids (and the BOS)
    that transformers' `AutoTokenizer.from_pretrained(folder, gguf_file=...)` gives: a
    sentencepiece-style "llama" vocabulary (BOS added, also where an older file does not say)
    and a byte-level "gpt2" one (none)."""
    from transformers import AutoTokenizer

    folder, _ = tiny_qwen2(tmp_path, monkeypatch) if family == "qwen2" else tiny_llama(tmp_path)
    gguf_file = tmp_path / "out" / "model.gguf"
    gguf_file.parent.mkdir()
    qtool.quantize(folder, gguf_file, "q8_0")
    if family != "llama" and family != "qwen2":  # the key gone, as in files older than it
        gguf_file = rewritten(
            gguf_file, gguf_file.with_name("older.gguf"), entries=edited("tokenizer.ggml.add_bos_token")
        )
        (gguf_file.parent / "model.gguf").unlink()
        assert "tokenizer.ggml.add_bos_token" not in dict((k, v) for k, v, _ in read_gguf_key_values(str(gguf_file)))
    notes: list[str] = []
    tokenizer = gguf_as_hugging_face(open_checkpoint(gguf_file)).tokenizer(notes)
    reference = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    assert type(tokenizer) is type(reference)
    text = "The quick brown fox, then the thin thistle: 3 33 333 ünïcödé <|im_start|> and 🦙.\n\n  x"
    for special in (True, False):
        assert (
            tokenizer(text, add_special_tokens=special).input_ids
            == reference(text, add_special_tokens=special).input_ids
        )
    with_bos = tokenizer(text).input_ids
    assert (with_bos[0] == tokenizer.bos_token_id) == family.startswith("llama")


# -- the real SmolLM2 GGUF against transformers' reading of it ------------------------------------------


def smollm2_gguf() -> Path:
    sys.path.insert(0, str(SAMPLES))
    try:
        from real_models import Unavailable, smollm2_gguf as find
    finally:
        sys.path.remove(str(SAMPLES))
    try:
        return find()
    except Unavailable as exc:
        pytest.skip(str(exc))


def pydoc_text(characters: int) -> str:
    sys.path.insert(0, str(SAMPLES))
    try:
        from real_models import pydoc_text as text
    finally:
        sys.path.remove(str(SAMPLES))
    return text()[:characters]


def test_smollm2s_config_and_tokenizer_are_transformers(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    path = smollm2_gguf()
    view = gguf_as_hugging_face(open_checkpoint(path))
    ours = AutoConfig.for_model(**view.checkpoint.config)
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    for name in (*(f for f in CONFIG_FIELDS[2:] if f != "rope_theta"), "rope_parameters", "pad_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert (ours.model_type, view.checkpoint.config["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert set(view.rows_back) == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(30) for p in ("q", "k")}

    notes: list[str] = []
    tokenizer = view.tokenizer(notes)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = pydoc_text(20_000)
    for special in (True, False):
        ids = tokenizer(text, add_special_tokens=special).input_ids
        assert ids == reference(text, add_special_tokens=special).input_ids and len(ids) > 3000
    assert (tokenizer.bos_token, tokenizer.eos_token) == (reference.bos_token, reference.eos_token)


def test_smollm2s_weights_and_config_give_transformers_own_logits():
    """The real Q4_1 file decoded by qtool under the view's names, q/k rows put back, in a model
    built from the view's config.json: the logits of transformers' own loading of the GGUF."""
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    view = gguf_as_hugging_face(open_checkpoint(path))
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([view.tokenizer([])(pydoc_text(2_000)).input_ids[:32]])
    assert_same_logits(view, decoded(view), reference, ids)


# -- hostile files: one error line each ---------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    qtool.quantize(TINY, out, "q8_0")
    return out


def rewritten(source: Path, out: Path, *, entries=None, renamed=None) -> Path:
    """`source` written again with its key-values edited by `entries(list) -> list` and its
    tensors renamed by `renamed` (old -> new), the data copied as it is."""
    kv = read_gguf_key_values(str(source))
    kv = entries(kv) if entries else kv
    checkpoint = open_checkpoint(source)
    stored = list(checkpoint.tensors.values())
    rename = renamed or {}
    tensors = [
        (rename.get(t.name, t.name), t.logical_shape or t.shape, t.encoding or t.dtype.name, t.nbytes) for t in stored
    ]
    header, ranges, size = gguf_header(kv, tensors)
    data = bytearray(size)
    data[: len(header)] = header
    for tensor, (name, *_) in zip(stored, tensors):
        begin, end = ranges[name]
        data[begin:end] = checkpoint.read_bytes(tensor)
    checkpoint.close()
    out.write_bytes(bytes(data))
    return out


def edited(key: str, value=None, kind: str | None = None):
    """An `entries` edit: `key` set to (value, kind), or dropped when value is None."""

    def edit(kv):
        kept = [(k, v, t) for k, v, t in kv if k != key]
        return kept if value is None else [*kept, (key, value, kind)]

    return edit


def refused(path: Path, error: type, needle: str, tokenizer: bool = False) -> str:
    with pytest.raises(error) as caught:
        view = gguf_as_hugging_face(open_checkpoint(path))
        if tokenizer:
            view.tokenizer([])
    message = str(caught.value)
    assert "\n" not in message and needle in message, message
    assert message.startswith(str(path)), message
    return message


def test_an_architecture_not_mapped_back_is_a_usage_error(llama_gguf, tmp_path):
    path = rewritten(llama_gguf, tmp_path / "gemma.gguf", entries=edited("general.architecture", b"gemma2", "STRING"))
    message = refused(path, UsageError, "a GGUF of architecture 'gemma2' is not mapped back")
    assert message == (
        f"{path}: a GGUF of architecture 'gemma2' is not mapped back to a Hugging Face model (qtool maps llama, qwen2)"
    )
    assert UsageError.exit_code == 2


BAD_METADATA = {
    "missing key": (edited("llama.block_count"), "metadata key llama.block_count is missing"),
    "wrong type": (
        edited("llama.embedding_length", b"256", "STRING"),
        "metadata key llama.embedding_length is a string, not an integer",
    ),
    "zero heads": (edited("llama.attention.head_count", 0, "UINT32"), "llama.attention.head_count is 0, not from 1"),
    "more heads than width": (
        lambda kv: edited("llama.attention.head_count", 512, "UINT32")(
            [e for e in kv if e[0] not in ("llama.attention.key_length", "llama.rope.dimension_count")]
        ),
        "llama.attention.head_count is 512, more heads than the 256 wide embedding has",
    ),
    "huge width": (edited("llama.feed_forward_length", 1 << 40, "UINT64"), "is 1099511627776, not from 1 to"),
    "integer epsilon": (
        edited("llama.attention.layer_norm_rms_epsilon", 1, "UINT32"),
        "layer_norm_rms_epsilon is a uint32, not a float",
    ),
    "nan theta": (edited("llama.rope.freq_base", float("nan"), "FLOAT32"), "is nan, not a finite positive number"),
    "kv heads not dividing": (
        edited("llama.attention.head_count_kv", 3, "UINT32"),
        "head_count_kv is 3, which does not divide the 4 attention heads",
    ),
    "per-layer kv heads": (
        edited("llama.attention.head_count_kv", [2, 2], "ARRAY:UINT32"),
        "llama.attention.head_count_kv is an array of uint32, not an integer",
    ),
    "partial rotary": (edited("llama.rope.dimension_count", 32, "UINT32"), "transformers' llama rotates whole heads"),
    "vocab_size disagrees": (
        edited("llama.vocab_size", 255, "UINT32"),
        "llama.vocab_size is 255, but token_embd.weight has 256 rows",
    ),
    "bos out of range": (
        edited("tokenizer.ggml.bos_token_id", 256, "UINT32"),
        "tokenizer.ggml.bos_token_id is 256, not a token id of the 256",
    ),
    "unknown rope scaling": (
        edited("llama.rope.scaling.type", b"longrope", "STRING"),
        "'longrope', a rope scaling qtool does not map back",
    ),
    "architecture not text": (
        edited("general.architecture", 7, "UINT32"),
        "metadata key general.architecture is a uint32, not a string",
    ),
}


@pytest.mark.parametrize("case", BAD_METADATA)
def test_bad_hyperparameters_are_one_checkpoint_error_naming_the_key(llama_gguf, tmp_path, case):
    edit, needle = BAD_METADATA[case]
    refused(rewritten(llama_gguf, tmp_path / "bad.gguf", entries=edit), CheckpointError, needle)


def fewer_tokens(kv):
    from qtool.formats.gguf import StringArray

    out = []
    for key, value, kind in kv:
        if key in ("tokenizer.ggml.tokens",):
            items = list(value)[:-1]
            raw = b"".join(struct.pack("<Q", len(item)) + item for item in items)
            value = StringArray(raw, len(items))
        out.append((key, value, kind))
    return out


def test_a_vocabulary_smaller_than_the_token_embedding_is_refused(llama_gguf, tmp_path):
    path = rewritten(llama_gguf, tmp_path / "vocab.gguf", entries=fewer_tokens)
    refused(path, CheckpointError, "tokenizer.ggml.tokens holds 255 tokens, but token_embd.weight has 256 rows")


def test_scores_not_one_per_token_are_refused(llama_gguf, tmp_path):
    path = rewritten(
        llama_gguf, tmp_path / "scores.gguf", entries=edited("tokenizer.ggml.scores", [0.0] * 3, "ARRAY:FLOAT32")
    )
    refused(path, CheckpointError, "tokenizer.ggml.scores holds 3 values, not one per token (256)")


@pytest.mark.parametrize(
    "renamed, needle",
    [
        ({"output_norm.weight": "mystery.weight"}, "tensor 'mystery.weight' has no Hugging Face name in a llama model"),
        ({"output_norm.weight": "rope_freqs.weight"}, "llama 3's rope scaling factors, which qtool does not map back"),
        ({"output_norm.weight": "model.norm.weight"}, "tensor 'model.norm.weight' has no Hugging Face name"),
    ],
)
def test_a_tensor_without_a_hugging_face_name_is_refused_naming_it(llama_gguf, tmp_path, renamed, needle):
    refused(rewritten(llama_gguf, tmp_path / "names.gguf", renamed=renamed), CheckpointError, needle)


def test_q_rows_that_do_not_split_into_rotary_heads_are_refused(llama_gguf, tmp_path):
    # 4 heads of 64 rows: k's 128 rows split into 2 heads' pairs; as 3 kv heads they do not
    kv = edited("llama.attention.head_count_kv", 3, "UINT32")
    heads = edited("llama.attention.head_count", 3, "UINT32")
    dims = edited("llama.rope.dimension_count")

    def edit(entries):
        return dims(heads(kv(entries)))

    path = rewritten(llama_gguf, tmp_path / "rows.gguf", entries=edit)
    refused(path, CheckpointError, "rows, not a whole number of its 3 rotary heads' pairs")


def test_a_gguf_without_a_tokenizer_reads_but_has_no_tokenizer(llama_gguf, tmp_path):
    path = rewritten(
        llama_gguf, tmp_path / "bare.gguf", entries=lambda kv: [e for e in kv if not e[0].startswith("tokenizer.")]
    )
    view = gguf_as_hugging_face(open_checkpoint(path))
    assert "bos_token_id" not in view.checkpoint.config
    refused(path, CheckpointError, "holds no tokenizer", tokenizer=True)


def test_a_vocabulary_transformers_cannot_convert_is_one_checkpoint_error(llama_gguf, tmp_path):
    path = rewritten(llama_gguf, tmp_path / "bogus.gguf", entries=edited("tokenizer.ggml.model", b"bogus", "STRING"))
    refused(path, CheckpointError, "transformers cannot build its tokenizer: Cannot build a tokenizer", tokenizer=True)


def test_a_token_that_is_not_utf8_is_refused_naming_the_key(llama_gguf, tmp_path):
    from qtool.formats.gguf import StringArray

    def edit(kv):
        out = []
        for key, value, kind in kv:
            if key == "tokenizer.ggml.tokens":
                items = [b"\xff\xfe", *list(value)[1:]]
                value = StringArray(b"".join(struct.pack("<Q", len(i)) + i for i in items), len(items))
            out.append((key, value, kind))
        return out

    path = rewritten(llama_gguf, tmp_path / "utf8.gguf", entries=edit)
    refused(path, CheckpointError, "metadata key tokenizer.ggml.tokens is not UTF-8 (item 0)", tokenizer=True)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    ],
)
def test_rope_scaling_in_the_gguf_comes_back_in_the_config(tmp_path, rope):
    from transformers import AutoConfig

    from tests.test_gguf_hf import tiny_llama_copy

    folder = tiny_llama_copy(tmp_path, config={"rope_scaling": rope})
    gguf_file = tmp_path / "scaled.gguf"
    qtool.quantize(folder, gguf_file, "q8_0")
    config = gguf_as_hugging_face(open_checkpoint(gguf_file)).checkpoint.config
    assert config["rope_scaling"] == rope
    fields = dict(config)
    built = AutoConfig.for_model(fields.pop("model_type"), **fields)
    assert built.rope_parameters == {**rope, "rope_theta": 10000.0}


WRONG_VALUES = [
    (b"x", "STRING"),
    (0, "UINT32"),
    (1 << 63, "UINT64"),
    (-1, "INT32"),
    (float("inf"), "FLOAT32"),
    (True, "BOOL"),
    ([1, 2], "ARRAY:INT32"),
]


def test_any_key_given_any_wrong_value_is_a_qtool_error_or_reads(llama_gguf, tmp_path):
    """Each key of a real file, given each kind of wrong value: the view and its tokenizer are
    built, or one QtoolError line says why; never another exception."""
    from qtool.errors import QtoolError

    keys = [key for key, _, _ in read_gguf_key_values(str(llama_gguf)) if key != "general.alignment"]
    outcomes = {"read": 0, "refused": 0}
    for key in keys:
        for number, (value, kind) in enumerate(WRONG_VALUES):  # a file each: the key-values are cached by identity
            path = rewritten(llama_gguf, tmp_path / f"{key}-{number}.gguf", entries=edited(key, value, kind))
            try:
                gguf_as_hugging_face(open_checkpoint(path)).tokenizer([])
                outcomes["read"] += 1
            except QtoolError as exc:
                assert "\n" not in str(exc), (key, value, str(exc))
                outcomes["refused"] += 1
    assert outcomes["refused"] > 5 * len(keys) and outcomes["read"] > 0, outcomes
