"""Calibration text memory (issue 42 #4): the tokenizer is handed one bounded piece at a time
and reading stops once the windows' pool is full, so memory follows what the run uses, not the
file (one 10 MB document cost 2.7 GB; 20 MB aborted in the Rust tokenizer). A spy tokenizer
records what it is handed; a text of short documents gives the windows it gave when each
document was tokenized whole."""

from __future__ import annotations

import json
import random

import pytest

from qtool.calibration import samples
from qtool.calibration.imatrix import chunk_tokens
from qtool.calibration.samples import SampleOptions, draw_samples, read_text
from qtool.errors import CheckpointError
from tests.conftest import SAMPLES

BOUND = 1 << 20  # the most characters the tokenizer may be handed at once


class SpyTokenizer:
    """A token per 5 characters, and a record of every text it was handed."""

    bos_token_id = None
    model_max_length = 1 << 30

    def __init__(self) -> None:
        self.handed: list[int] = []

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        self.handed.append(len(text))
        return {"input_ids": [ord(c) for c in text[::5]]}


def _long_text(characters: int) -> str:
    paragraph = "\n".join(" ".join(["word"] * 12) for _ in range(8)) + "\n\n"
    return paragraph * (characters // len(paragraph) + 1)


@pytest.fixture(params=["txt", "jsonl", "no breaks"])
def long_text(tmp_path, request):
    """One document of 3 MiB: a .txt, a .jsonl line, or a .txt of one unbroken word."""
    text = "x" * (3 << 20) if request.param == "no breaks" else _long_text(3 << 20)
    if request.param == "jsonl":
        path = tmp_path / "t.jsonl"
        path.write_text(json.dumps({"text": text}) + "\n")
    else:
        path = tmp_path / "t.txt"
        path.write_text(text)
    return path, text


def test_a_long_document_reaches_the_tokenizer_in_bounded_pieces(long_text):
    path, text = long_text
    spy = SpyTokenizer()
    draw_samples(read_text(path), spy, SampleOptions(1, 2), str(path))
    assert max(spy.handed) <= BOUND
    assert sum(spy.handed) == len(text)  # every character, each once: the pool (4M tokens) is not full


def test_the_imatrix_chunks_reach_the_tokenizer_in_bounded_pieces(long_text):
    path, _ = long_text
    spy = SpyTokenizer()
    chunk_tokens(read_text(path), spy, 16, None, str(path))
    assert max(spy.handed) <= BOUND


def test_reading_stops_once_the_pool_is_full(tmp_path, monkeypatch):
    monkeypatch.setattr(samples, "MIN_POOL_TOKENS", 1000)
    path = tmp_path / "t.txt"
    path.write_text(_long_text(8 << 20))
    spy = SpyTokenizer()
    tokens = draw_samples(read_text(path), spy, SampleOptions(4, 16), str(path))
    assert tuple(tokens.shape) == (4, 16)
    assert sum(spy.handed) <= BOUND  # one piece held the pool: the other 7 MiB were never tokenized


def test_the_imatrix_reads_only_the_chunks_asked_for(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(_long_text(8 << 20))
    spy = SpyTokenizer()
    tokens = chunk_tokens(read_text(path), spy, 16, 3, str(path))
    assert tuple(tokens.shape) == (3, 16)
    assert sum(spy.handed) <= BOUND + 1  # the probe "a", then one piece


def _whole(documents: list[str], tokenizer, options: SampleOptions):
    """The windows as they were drawn before issue 42: every document tokenized whole."""
    ids: list[int] = []
    for document in documents:
        ids.extend(tokenizer(document, add_special_tokens=False)["input_ids"])
    windows = len(ids) // options.seq_len
    chosen = random.Random(options.seed).sample(range(windows), options.samples)
    return [ids[w * options.seq_len : (w + 1) * options.seq_len] for w in chosen]


def test_a_text_of_short_documents_gives_the_windows_of_whole_documents(tmp_path):
    pytest.importorskip("transformers")
    from qtool.calibration.samples import load_tokenizer

    words = (
        "An iterator is created for the result of the expression list. Then the suite is executed once for each item."
    )
    documents = [" ".join(words.split()[i % 7 :]) * (3 + i) + "\n\n" + words for i in range(40)]
    (tmp_path / "a.txt").write_text(documents[0])
    (tmp_path / "b.jsonl").write_text("\r\n".join(json.dumps({"text": d}) for d in documents[1:]) + "\n\n")
    tokenizer = load_tokenizer(str(SAMPLES / "tiny-llama"))
    options = SampleOptions(6, 32, 5)
    tokens = draw_samples(read_text(tmp_path), tokenizer, options, str(tmp_path))
    assert tokens.tolist() == _whole(documents, tokenizer, options)


def test_a_bad_byte_past_the_first_read_is_named_by_its_offset(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"a" * ((1 << 20) - 1) + "é".encode() + b"b" * 10 + b"\xff" + b"c" * 10)
    with pytest.raises(CheckpointError, match=rf"is not UTF-8 text \(byte {(1 << 20) - 1 + 2 + 10}\)"):
        list(read_text(path).pieces())


def test_a_jsonl_line_is_named_by_its_number_across_reads(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [json.dumps({"text": "x" * 1000})] * 3000 + ['{"txt": 1}']
    path.write_text("\n".join(lines))
    with pytest.raises(CheckpointError, match='line 3001 has no string field "text"'):
        list(read_text(path).pieces())
