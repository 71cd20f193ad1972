"""Calibration text to token windows: a `.txt` file, a `.jsonl` file with a `text` field per
line, or a folder of them (its files in name order), tokenized with the model's own tokenizer,
cut into windows of `seq_len` tokens and `samples` of them drawn with `seed`.

Every bad input is one line naming the file: a missing or empty text, a file that is not a
regular file (a FIFO, a link to a device), a JSON line without a string `text`, a text with
fewer tokens than samples x seq_len (saying how many it has).

Memory is bounded by what the run uses, not by the file: each file is opened once through
`qtool.formats.regular_files` (a FIFO never blocks, a device is never read) and read in
pieces, never whole; the tokenizer (which holds ~270 bytes per character while it works) is
handed one piece at a time: a document, or a long document's pieces of at most
`PIECE_CHARS` characters cut at a paragraph break (else a line break, else a space); and
reading stops once the windows' pool of tokens is full. A text whose documents are all under
`PIECE_CHARS` and whose tokens are fewer than the pool gives the windows it gave when it was
tokenized whole.
"""

from __future__ import annotations

import codecs
import os
import random
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING
from collections.abc import Iterator

from qtool.errors import CheckpointError, UsageError
from qtool.message_text import excerpt

if TYPE_CHECKING:
    import torch

__all__ = [
    "SampleOptions",
    "CalibrationText",
    "read_text",
    "draw_samples",
    "token_pieces",
    "load_tokenizer",
    "tokenized",
]

MAX_TEXT_BYTES = 1 << 30  # a calibration text larger than this is surely a mistake
PIECE_CHARS = 1 << 20  # the most characters the tokenizer is handed at once (~300 MB while it works)
MIN_POOL_TOKENS = 1 << 22  # windows are drawn from the first max(samples x seq_len, this) tokens
_READ = 1 << 20  # bytes read from a file at a time
_MAX_LINE = 64 << 20  # a .jsonl line: parse_json's own limit (qtool.formats.untrusted_json)


@dataclass(frozen=True)
class SampleOptions:
    samples: int = 128
    seq_len: int = 512
    seed: int = 0

    def check(self) -> None:
        if self.samples < 1:
            raise UsageError(f"samples {self.samples} must be at least 1", option="samples")
        if self.seq_len < 2:
            raise UsageError(f"seq_len {self.seq_len} must be at least 2", option="seq_len")


def _noun(option: str) -> str:
    """What the text is called in a message: `--calibrate`'s a calibration text, `--text`'s a text."""
    return "calibration text" if option == "calibrate" else "text"


def _files(path: str, option: str) -> list[str]:
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith((".txt", ".jsonl")))
        if not names:
            raise UsageError(f"{path}: the folder holds no .txt or .jsonl file", option=option)
        return [os.path.join(path, n) for n in names]
    if not os.path.lexists(path):
        raise UsageError(f"{path}: no such {_noun(option)}", option=option)
    if not path.endswith((".txt", ".jsonl")):
        raise UsageError(f"{path}: a {_noun(option)} is a .txt or .jsonl file, or a folder of them", option=option)
    return [path]


def _checked(path: str) -> os.stat_result:
    """The stat of one calibration file: a regular file (links followed) within the size cap.
    Checked for every file before any is read, so a FIFO or a device fails before the
    tokenizer loads; the open itself checks again (`open_regular`)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"cannot be read: {exc.strerror}", path=path) from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(
            "cannot be read: it is not a regular file",
            path=path,
            hint="a calibration text is a .txt or .jsonl file, or a folder of them",
        )
    if info.st_size > MAX_TEXT_BYTES:
        raise CheckpointError(f"is {info.st_size} bytes, more than a calibration text's {MAX_TEXT_BYTES}", path=path)
    return info


def _chunks(path: str, info: os.stat_result) -> Iterator[str]:
    """The file's text, decoded as UTF-8 a piece at a time, at most MAX_TEXT_BYTES in all."""
    from qtool.formats.regular_files import NotReadable, open_regular

    try:
        fd, _ = open_regular(path, expect=info)
    except NotReadable as exc:
        raise CheckpointError(f"cannot be read: {exc}", path=path) from None
    decoder = codecs.getincrementaldecoder("utf-8")()
    done = 0
    try:
        while True:
            try:
                raw = os.read(fd, _READ)
            except OSError as exc:
                raise CheckpointError(f"cannot be read: {exc.strerror}", path=path) from None
            if done + len(raw) > MAX_TEXT_BYTES:
                raise CheckpointError(
                    f"grew past a calibration text's {MAX_TEXT_BYTES} bytes while it was read", path=path
                )
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as exc:
                raise CheckpointError(f"is not UTF-8 text (byte {_byte(done, raw, exc)})", path=path) from None
            done += len(raw)
            if text:
                yield text
            if not raw:
                return
    finally:
        os.close(fd)


def _byte(done: int, raw: bytes, exc: UnicodeDecodeError) -> int:
    """The file offset of a bad UTF-8 byte: `exc.start` counts from the bytes the incremental
    decoder held over from the previous read (exc.object is those bytes + `raw`)."""
    return done - (len(exc.object) - len(raw)) + exc.start


def _cut(text: str, limit: int) -> int:
    """Where to end a piece of at most `limit` characters of `text`: after its last paragraph
    break, else its last line break, else its last space, else at the limit."""
    for mark in ("\n\n", "\n", " "):
        at = text.rfind(mark, limit // 2, limit)
        if at >= 0:
            return at + len(mark)
    return limit


def _split(document: str, limit: int) -> Iterator[str]:
    while len(document) > limit:
        at = _cut(document, limit)
        yield document[:at]
        document = document[at:]
    yield document


def _txt_pieces(path: str, info: os.stat_result, limit: int) -> Iterator[str]:
    """A .txt file is one document: whole when it is short, else in pieces."""
    buffer = ""
    for text in _chunks(path, info):
        *done, buffer = _split(buffer + text, limit)
        yield from done
    yield buffer


def _jsonl_pieces(path: str, info: os.stat_result, limit: int) -> Iterator[str]:
    """Each line's `text` (lines as str.splitlines cuts them), in pieces where it is long."""
    from qtool.formats.untrusted_json import parse_json

    number = 0
    buffer = ""
    chunks = _chunks(path, info)
    while True:
        text = next(chunks, None)
        if text is not None:
            newline = text.rfind("\n")  # searched in the new text only: a long line stays linear
            end = len(buffer) + newline + 1 if newline >= 0 else 0  # complete lines only: \r\n stays whole
            buffer += text
            if not end:
                if len(buffer) > _MAX_LINE:
                    raise CheckpointError(f"line {number + 1} is longer than {_MAX_LINE} characters", path=path)
                continue
            lines, buffer = buffer[:end].splitlines(), buffer[end:]
        else:
            lines, buffer = buffer.splitlines(), ""
        for line in lines:
            number += 1
            if not line.strip():
                continue
            value = parse_json(line, path, where=f"line {number}")
            document = value.get("text") if isinstance(value, dict) else None
            if not isinstance(document, str):
                raise CheckpointError(f'line {number} has no string field "text"', path=path)
            yield from _split(document, limit)
        if text is None:
            return


@dataclass(frozen=True)
class CalibrationText:
    """A calibration text whose files are checked and not yet read: `pieces()` reads them."""

    path: str
    files: tuple[tuple[str, os.stat_result], ...]
    option: str = "calibrate"  # the option that named it, for its messages

    def pieces(self, limit: int = PIECE_CHARS) -> Iterator[str]:
        """The documents in order, a long one in pieces of at most `limit` characters, blank
        ones left out; an empty text is refused once it has been read to its end."""
        empty = True
        for file, info in self.files:
            pieces = _jsonl_pieces(file, info, limit) if file.endswith(".jsonl") else _txt_pieces(file, info, limit)
            for piece in pieces:
                if piece.strip():
                    empty = False
                    yield piece
        if empty:
            raise UsageError(f"{self.path}: the {_noun(self.option)} is empty", option=self.option)


def read_text(path: str | os.PathLike[str], option: str = "calibrate") -> CalibrationText:
    """The text at `path` (named by `option`), its files checked (regular, within the size cap)
    and read later, a piece at a time."""
    path = os.fspath(path)
    return CalibrationText(path, tuple((file, _checked(file)) for file in _files(path, option)), option)


def token_pieces(text: CalibrationText, tokenizer, limit: int = PIECE_CHARS) -> Iterator[list[int]]:
    """The token ids of each piece of `text` (no special tokens), the tokenizer handed at most
    `limit` characters at a time."""
    tokenizer.model_max_length = 1 << 62  # the text is cut into windows here; no warning about its length
    for piece in text.pieces(limit):
        yield tokenized(tokenizer, piece, add_special_tokens=False)


def load_tokenizer(model_folder: str, notes: list[str] | None = None, option: str = "calibrate"):
    """The model's own tokenizer from its folder (local files only, never the folder's own
    code: `qtool.formats.transformers_boundary`), or a one-line refusal naming `option`. What
    transformers logs meanwhile goes to `notes`."""
    from qtool.formats.transformers_boundary import auto_tokenizer

    if not model_folder or not os.path.isdir(model_folder):
        raise UsageError(
            f"{model_folder}: {'calibration' if option == 'calibrate' else 'evaluation'} needs a model folder with its tokenizer",
            option=option,
        )
    if not any(
        os.path.isfile(os.path.join(model_folder, n))
        for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    ):
        raise UsageError(
            f"{model_folder} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)",
            hint="the text is tokenized with the model's own tokenizer",
            option=option,
        )
    try:
        return auto_tokenizer(model_folder, model_folder, [] if notes is None else notes)
    except (CheckpointError, UsageError):
        raise
    except Exception as exc:  # transformers raises anything from OSError to ValueError here
        raise UsageError(
            f"{model_folder}: its tokenizer cannot be loaded ({type(exc).__name__}: {excerpt(str(exc).splitlines()[0]) if str(exc) else ''})",
            option=option,
        ) from None


def tokenized(tokenizer, text: str, **options) -> list[int]:
    """The token ids of `text`; a panic in the Rust tokenizer (a regex that backtracks) is one
    line naming the tokenizer file."""
    from qtool.formats.transformers_boundary import tokenizer_panics

    with tokenizer_panics(os.path.join(str(getattr(tokenizer, "name_or_path", "") or "."), "tokenizer.json")):
        return tokenizer(text, **options)["input_ids"]


def draw_samples(text: CalibrationText, tokenizer, options: SampleOptions, where: str) -> torch.Tensor:
    """[samples, seq_len] int64 token ids: the text tokenized a piece at a time and joined into
    a pool of its first max(samples x seq_len, MIN_POOL_TOKENS) tokens (reading stops there),
    cut into non-overlapping windows, `samples` of them drawn with `seed` (the same every run)."""
    from array import array

    import torch

    options.check()
    needed = options.samples * options.seq_len
    pool = max(needed, MIN_POOL_TOKENS)
    ids = array("q")
    for piece in token_pieces(text, tokenizer):
        ids.extend(piece[: pool - len(ids)])
        if len(ids) >= pool:
            break
    windows = len(ids) // options.seq_len
    if windows < options.samples:
        raise UsageError(
            f"{where}: the calibration text has {len(ids)} tokens, fewer than samples x seq_len = {options.samples} x {options.seq_len} = {needed}",
            hint="give more text, or fewer samples or a shorter seq_len",
            option="calibrate",
        )
    chosen = random.Random(options.seed).sample(range(windows), options.samples)
    tokens = torch.frombuffer(ids, dtype=torch.int64)[: windows * options.seq_len].view(windows, options.seq_len)
    return tokens[torch.tensor(chosen)]
