"""The tokenizer of a Hugging Face checkpoint as GGUF's `tokenizer.ggml.*` keys (and
`tokenizer.chat_template`), so llama.cpp tokenizes as the model's tokenizer does.

The keys follow llama.cpp's own converter (`convert_hf_to_gguf.py`, read at llama.cpp
0c1e57098bba43ac29e6e3b677cdceebdd22334f: `LlamaModel.set_vocab`, `_set_vocab_sentencepiece`,
`_set_vocab_llama_hf`, `_set_vocab_gpt2`, `get_vocab_base_pre`) and are built with gguf-py's own
helpers (`SentencePieceVocab`, `SpecialVocab`, `GGUFWriter`'s key setters as a recorder):

    tokenizer.model (sentencepiece installed)     "llama" tokenizer, sentencepiece's scores (gguf-py's
                                                  SentencePieceVocab); without sentencepiece, refused
    tokenizer.json, BPE with byte fallback        "llama" tokenizer (LLaMA 1/2, Mistral): LlamaHfVocab's tokens
                                                  (its <0xNN> byte tokens required: llama.cpp aborts without)
    tokenizer.json, byte-level BPE                "gpt2" tokenizer (LLaMA 3, Qwen2, SmolLM), its pre-tokenizer
                                                  named by the hash of a reference text's tokens
                                                  (read with transformers, which imports torch)

A model without a tokenizer, or with a pre-tokenizer llama.cpp's table does not name, is refused
unless the caller allows an incomplete GGUF.

The tokenizer files come from strangers: only regular files inside the model's folder (not
links out of it), each under SIDE_FILE_LIMIT, are copied into a private folder, and gguf-py and
transformers read that copy. Anything they raise becomes one CheckpointError naming the folder;
transformers is called as `qtool.formats.transformers_boundary` calls it (the folder's own code
never trusted, never asked about; what it logs a warning; a panic in the Rust tokenizer a
CheckpointError naming tokenizer.json).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from qtool.errors import CheckpointError, UsageError
from qtool.formats.regular_files import NotReadable, read_regular
from qtool.message_text import excerpt
from qtool.side_files import SIDE_FILE_LIMIT, linked_out

__all__ = ["tokenizer_entries", "llama_hf_tokens", "refuse_or_note", "BPE_PRE_TOKENIZERS"]

_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "added_tokens.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja", "config.json", "generation_config.json",
)  # fmt: skip

# The BPE pre-tokenizers llama.cpp knows for the LLaMA family, by the sha256 of str(token ids) of
# its reference text (`get_vocab_base_pre` in convert_hf_to_gguf.py, llama.cpp 0c1e570): facts
# from that table, for the models this module writes.
BPE_PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3-8B
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",  # Smaug-Llama-3-70B
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5 / Qwen2 / Qwen2.5
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3-Embedding
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",  # R1-Distill-Qwen
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral-Nemo
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM (LlamaForCausalLM)
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # gpt2
}
# The reference text whose token ids name the pre-tokenizer (the same string as llama.cpp's).
_PRE_TOKENIZER_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 3333 "
    "33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)


def refuse_or_note(allow_incomplete: bool, notes: list[str], message: str, hint: str) -> None:
    """Refuse what llama.cpp could not run (a UsageError naming the allowing parameter), or,
    when an incomplete GGUF is allowed, note it as a warning and go on."""
    if not allow_incomplete:
        raise UsageError(
            message,
            hint=f"{hint}, or allow an incomplete GGUF that no runtime may load",
            option="allow_incomplete_gguf",
        )
    notes.append(f"writing an incomplete GGUF: {message}")


def tokenizer_entries(
    folder: str, arch: str, vocab_size: int | None, allow_incomplete: bool, notes: list[str]
) -> list[tuple[str, Any, str]]:
    """The `tokenizer.ggml.*` keys (and the chat template) of the model in `folder`, padded to
    `vocab_size` tokens, as (key, value, GGUFValueType name)."""
    with _staged(folder) as staged:
        present = set(os.listdir(staged))
        if not present & {"tokenizer.json", "tokenizer.model"}:
            refuse_or_note(
                allow_incomplete,
                notes,
                f"{folder} has no tokenizer.json or tokenizer.model, and llama.cpp cannot run a GGUF without a tokenizer",
                "put the model's tokenizer files beside it",
            )
            return []
        with _gguf_warnings(notes), _as_checkpoint_error(folder, staged):
            return _vocab_entries(staged, present, arch, vocab_size, allow_incomplete, notes, folder)


def _vocab_entries(
    staged: Path,
    present: set[str],
    arch: str,
    vocab_size: int | None,
    allow_incomplete: bool,
    notes: list[str],
    folder: str,
) -> list[tuple[str, Any, str]]:
    import gguf

    writer = gguf.GGUFWriter(None, arch)  # a recorder: its key setters fill kv_data, nothing is written
    if "tokenizer.model" in present and _has_sentencepiece():
        _sentencepiece(writer, staged, vocab_size)
    elif "tokenizer.json" not in present:
        raise CheckpointError(
            "has only tokenizer.model, and reading it needs the sentencepiece package",
            path=folder,
            hint="pip install sentencepiece",
        )
    else:
        document = _json_object(staged / "tokenizer.json")
        model = document.get("model")
        kind = model.get("type") if isinstance(model, dict) else None
        if kind == "BPE" and _byte_level(document):
            _gpt2(writer, staged, vocab_size, allow_incomplete, notes, folder)
        elif kind == "BPE" and model.get("byte_fallback") and arch == "llama":
            if not _has_byte_tokens(model):
                raise CheckpointError(
                    "its tokenizer.json is BPE with byte fallback but has no <0xNN> byte tokens and no byte-level pre-tokenizer, "
                    "so llama.cpp could not encode a byte outside its vocabulary (llama_vocab::byte_to_token aborts)",
                    path=folder, hint="give the model's original tokenizer.json",
                )  # fmt: skip
            _llama_hf(writer, staged, vocab_size)
        elif kind == "BPE" and not model.get("byte_fallback"):
            _gpt2(writer, staged, vocab_size, allow_incomplete, notes, folder)
        else:
            what = (
                f"a {kind[:40]} tokenizer" if isinstance(kind, str) else "not a tokenizer qtool knows (no model type)"
            )
            raise CheckpointError(
                f"its tokenizer.json is {what}, which qtool does not write into a {arch} GGUF",
                path=folder,
                hint="llama.cpp's convert_hf_to_gguf.py may convert it",
            )
    config_file = staged / "tokenizer_config.json"
    if config_file.is_file():
        prefix = _json_object(config_file).get("add_prefix_space")
        if isinstance(prefix, bool):
            writer.add_add_space_prefix(prefix)
    arch_key = gguf.Keys.General.ARCHITECTURE
    return [(key, value.value, value.type.name) for key, value in writer.kv_data[0].items() if key != arch_key]


def _json_object(path: Path) -> dict[str, Any]:
    """A tokenizer file's JSON object, read with qtool's limits for JSON from strangers. What is
    wrong is a ValueError naming the file, which `_as_checkpoint_error` reports against the
    model folder (this reads the private staged copy)."""
    from qtool.formats.untrusted_json import parse_json

    try:
        value = parse_json(path.read_bytes(), path.name)
    except CheckpointError as exc:
        raise ValueError(f"{path.name} {exc.message}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return value


def _byte_level(document: dict[str, Any]) -> bool:
    """Whether a tokenizer.json maps bytes to symbols before BPE (GPT-2's ByteLevel, alone or in
    a Sequence, as pre-tokenizer or decoder): llama.cpp's "gpt2" tokenizer. Its vocabulary holds
    every byte as a symbol, so a `byte_fallback: true` beside it (transformers' GGUF reader
    was seen in a SmolLM2 folder) never fires, and writing it as a SentencePiece-style "llama"
    vocabulary without <0xNN> tokens makes llama.cpp abort on the first text."""
    for part in (document.get("pre_tokenizer"), document.get("decoder")):
        if not isinstance(part, dict):
            continue
        members = (part.get("pretokenizers") or part.get("decoders")) if part.get("type") == "Sequence" else [part]
        if isinstance(members, list) and any(
            isinstance(m, dict) and m.get("type") == "ByteLevel" for m in members[:64]
        ):
            return True
    return False


def _has_byte_tokens(model: dict[str, Any]) -> bool:
    """Whether a byte-fallback vocabulary has its <0xNN> tokens, which llama.cpp's SPM tokenizer
    falls back to (a trimmed vocabulary may hold only some)."""
    vocab = model.get("vocab")
    return isinstance(vocab, dict) and any(f"<0x{byte:02X}>" in vocab for byte in range(256))


def _has_sentencepiece() -> bool:
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        return False
    return True


def _padded(tokens: list, scores: list[float] | None, types: list[int], vocab_size: int | None) -> None:
    """Pad the lists to the model's vocabulary with unused `[PADi]` tokens, as the converter does;
    a tokenizer larger than the model's embedding is refused."""
    import gguf

    if vocab_size is None:
        return
    if len(tokens) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens, more than the model's {vocab_size}")
    for index in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{index}]".encode())
        types.append(int(gguf.TokenType.UNUSED))
        if scores is not None:
            scores.append(-1000.0)


def _sentencepiece(writer, staged: Path, vocab_size: int | None) -> None:
    """`_set_vocab_sentencepiece`: the pieces with their real scores and types."""
    import gguf

    vocab = gguf.SentencePieceVocab(staged)
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(float(score))
        types.append(int(kind))
    _override_added(staged, tokens, scores, types)
    _padded(tokens, scores, types, vocab_size)
    _write_vocab(writer, "llama", "default", tokens, scores, types)
    gguf.SpecialVocab(staged, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def _override_added(staged: Path, tokens: list, scores: list[float], types: list[int]) -> None:
    """tokenizer_config.json's `added_tokens_decoder` replaces pieces in place, as CONTROL
    (special, or looks special) or USER_DEFINED tokens."""
    import gguf

    config_file = staged / "tokenizer_config.json"
    if not config_file.is_file():
        return
    decoder = _json_object(config_file).get("added_tokens_decoder") or {}
    for key, data in decoder.items():
        index, content = int(key), data["content"]
        if not 0 <= index < len(tokens) or not isinstance(content, str):
            continue
        special = bool(data.get("special")) or _looks_special(content)
        if not special:
            content = content.replace("\u2581", " ")
        tokens[index], scores[index] = content.encode("utf-8"), -1000.0
        types[index] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)


def _llama_hf(writer, staged: Path, vocab_size: int | None) -> None:
    """`_set_vocab_llama_hf`: a LLaMA tokenizer.json (BPE with byte fallback), token for token
    what gguf-py's `LlamaHfVocab` yields (tests/test_gguf_hf.py compares the two), read from
    the JSON itself: LlamaHfVocab loads it through transformers, which imports torch."""
    import gguf

    tokens, scores, types = llama_hf_tokens(staged)
    _padded(tokens, scores, types, vocab_size)
    _write_vocab(writer, "llama", "default", tokens, scores, types)
    gguf.SpecialVocab(staged, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def llama_hf_tokens(folder: Path) -> tuple[list[bytes], list[float], list[int]]:
    """(tokens, scores, types) of a LLaMA tokenizer.json: the base vocabulary by id (score
    -1000; BYTE for `<0xXX>`, CONTROL for special tokens, else NORMAL), then the added tokens
    beyond it (CONTROL if special, else USER_DEFINED), as `LlamaHfVocab.all_tokens` gives them."""
    import re

    import gguf

    tokenizer = _json_object(folder / "tokenizer.json")
    vocab = tokenizer["model"]["vocab"]
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()):
        raise ValueError("tokenizer.json's model.vocab is not a map of token to id")
    by_id = {index: text for text, index in vocab.items()}
    base = len(vocab)
    if len(by_id) != base or (base and (min(by_id) != 0 or max(by_id) != base - 1)):
        raise ValueError("tokenizer.json's vocabulary ids are not 0..n-1, each once")
    added: dict[int, tuple[str, bool]] = {}
    for entry in tokenizer.get("added_tokens") or []:
        index, content = entry["id"], entry["content"]
        if not isinstance(index, int) or not isinstance(content, str):
            raise ValueError("tokenizer.json's added_tokens hold a token without an integer id and a text")
        added[index] = (content, bool(entry.get("special")))
    special_ids = {index for index, (_, special) in added.items() if special} | _configured_special_ids(
        folder, vocab, added
    )
    extra = sorted(index for index in added if index >= base)
    if extra != list(range(base, base + len(extra))):
        raise ValueError(
            f"tokenizer.json's added tokens beyond the {base} base tokens are not numbered from {base} on, each once"
        )
    byte_token = re.compile(r"<0x[0-9A-Fa-f]{2}>")
    tokens, types = [], []
    for index in range(base):
        text = by_id[index]
        tokens.append(text.encode("utf-8"))
        kind = (
            gguf.TokenType.BYTE
            if byte_token.fullmatch(text)
            else gguf.TokenType.CONTROL
            if index in special_ids
            else gguf.TokenType.NORMAL
        )
        types.append(int(kind))
    for index in extra:
        text, _ = added[index]
        tokens.append(text.encode("utf-8"))
        types.append(int(gguf.TokenType.CONTROL if index in special_ids else gguf.TokenType.USER_DEFINED))
    return tokens, [-1000.0] * len(tokens), types


def _configured_special_ids(folder: Path, vocab: dict[str, int], added: dict[int, tuple[str, bool]]) -> set[int]:
    """Ids of tokenizer_config.json's bos/eos/unk/sep/pad/cls/mask tokens and
    `additional_special_tokens` (transformers' `all_special_ids`)."""
    config_file = folder / "tokenizer_config.json"
    config = _json_object(config_file) if config_file.is_file() else {}
    named = [config.get(f"{kind}_token") for kind in ("bos", "eos", "unk", "sep", "pad", "cls", "mask")]
    extra = config.get("additional_special_tokens")
    named += extra if isinstance(extra, list) else []
    ids = {text: index for index, (text, _) in added.items()}
    found = set()
    for entry in named:
        text = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(text, str):
            index = ids.get(text, vocab.get(text))
            if index is not None:
                found.add(index)
    return found


def _gpt2(writer, staged: Path, vocab_size: int | None, allow_incomplete: bool, notes: list[str], folder: str) -> None:
    """`_set_vocab_gpt2`: a byte-level BPE vocabulary, its merges, and the name of its
    pre-tokenizer, which llama.cpp knows by the hash of a reference text's token ids."""
    import gguf

    from qtool.formats.transformers_boundary import auto_tokenizer, tokenizer_panics

    tokenizer = auto_tokenizer(str(staged), folder, notes)  # the folder's own code never runs, nor is asked about
    vocab = tokenizer.get_vocab()
    size = vocab_size or len(vocab)
    if vocab and max(vocab.values()) >= size:
        raise ValueError(f"the tokenizer has token id {max(vocab.values())}, beyond the model's {size} tokens")
    import hashlib

    with tokenizer_panics(os.path.join(folder, "tokenizer.json")):
        digest = hashlib.sha256(str(tokenizer.encode(_PRE_TOKENIZER_TEXT)).encode()).hexdigest()
    pre = BPE_PRE_TOKENIZERS.get(digest)
    if pre is None:
        refuse_or_note(
            allow_incomplete, notes,
            f"{folder}: llama.cpp does not know this tokenizer's pre-tokenizer (hash {digest}); qtool names those of {', '.join(sorted(set(BPE_PRE_TOKENIZERS.values())))}",
            "convert it with llama.cpp's convert_hf_to_gguf.py",
        )  # fmt: skip
        pre = "default"
    by_id = {index: text for text, index in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens: list = []
    types: list[int] = []
    for index in range(size):
        text = by_id.get(index)
        if text is None:
            tokens.append(f"[PAD{index}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        kind = gguf.TokenType.NORMAL
        if text in added:
            entry = decoder.get(index)
            if entry is not None and not entry.normalized:  # llama.cpp expects added tokens pre-normalized
                with tokenizer_panics(os.path.join(folder, "tokenizer.json")):
                    text = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
            if (entry is not None and entry.special) or _looks_special(text):
                kind = gguf.TokenType.CONTROL
            else:
                text = text.replace("\u2581", " ")
                kind = gguf.TokenType.USER_DEFINED
        tokens.append(text)
        types.append(int(kind))
    _write_vocab(writer, "gpt2", pre, tokens, None, types)
    gguf.SpecialVocab(staged, load_merges=True).add_to_gguf(writer, quiet=True)


def _write_vocab(writer, model: str, pre: str, tokens: list, scores: list[float] | None, types: list[int]) -> None:
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_token_types(types)


def _looks_special(text: str) -> bool:
    """Added tokens some models forget to mark special (`does_token_look_special`)."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


# -- reading strangers' tokenizer files ------------------------------------------------------------


@contextlib.contextmanager
def _staged(folder: str) -> Iterator[Path]:
    """A private copy of the folder's tokenizer files: regular files inside it (a Hugging Face
    cache's blobs aside), each at most SIDE_FILE_LIMIT bytes. The vocab helpers read only this."""
    import tempfile  # here: a GGUF input never stages a tokenizer (tempfile imports random)

    with tempfile.TemporaryDirectory(prefix="qtool-tokenizer-") as staged:
        for name in _TOKENIZER_FILES:
            path = os.path.join(folder, name)
            try:
                info = os.stat(path)
            except OSError:
                continue
            if linked_out(path) or not stat.S_ISREG(info.st_mode) or info.st_size > SIDE_FILE_LIMIT:
                continue
            try:  # one descriptor, the inode just checked: a swap meanwhile is refused, a FIFO never waited on
                content = read_regular(path, SIDE_FILE_LIMIT, expect=info)
            except NotReadable as exc:
                raise CheckpointError(f"cannot read: {exc}", path=path) from None
            except OSError as exc:
                raise CheckpointError(f"cannot read: {exc.strerror}", path=path) from None
            if len(content) > SIDE_FILE_LIMIT:
                continue
            with open(os.path.join(staged, name), "wb") as handle:
                handle.write(content)
        yield Path(staged)


@contextlib.contextmanager
def _as_checkpoint_error(folder: str, staged: Path) -> Iterator[None]:
    """Whatever a vocab helper raises on a malformed tokenizer becomes one CheckpointError line."""
    try:
        yield
    except (CheckpointError, UsageError):
        raise
    except Exception as exc:
        detail = (
            f"no entry {exc}"
            if isinstance(exc, KeyError)
            else excerpt(" ".join(str(exc).replace(str(staged), folder).split())) or type(exc).__name__
        )
        raise CheckpointError(
            f"cannot read its tokenizer: {detail}", path=folder, hint="fix or replace the tokenizer files"
        ) from None


@contextlib.contextmanager
def _gguf_warnings(notes: list[str]) -> Iterator[None]:
    """gguf-py's vocab helpers log what they skip; those lines become the run's warnings."""

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                notes.append("tokenizer: " + excerpt(" ".join(record.getMessage().split())))

    logger = logging.getLogger("gguf")
    handler, propagate = Collect(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
