"""Where qtool hands a stranger's model folder to transformers, and what comes back.

A Hugging Face folder can name Python of its own (`auto_map` in config.json or
tokenizer_config.json, beside an `evil.py`). transformers imports it when told to trust it, and,
when not told either way, asks "Do you wish to run the custom code? [y/N]" on stdout and reads the
answer from stdin: a prompt that breaks `--json` and a `y` that runs the folder's code. qtool never
runs a model folder's code: every transformers entry point it calls passes
`trust_remote_code=False` (`TRUST`), so transformers never asks, and a folder that needs its code
is refused in one line naming the file that asks for it.

transformers and torch also talk while they load: log lines and Python warnings, with values
from the folder in them (a `rope_type` holding a terminal escape). `collected` catches them for
the length of a call and hands them back as notes, which reach the user as qtool's warnings do
(escaped by the CLI), never as raw text on the terminal.

The Rust tokenizer panics on a pre-tokenizer regex that backtracks past Oniguruma's retry
limit; pyo3 raises that as a `PanicException`, a BaseException (not an Exception) in the
tokenizers releases up to 0.23 at least. `tokenizer_panics` turns it into a CheckpointError
naming the tokenizer file. (Rust's panic hook has written its message to stderr by then: that
text is the library's own, not the folder's.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any
from collections.abc import Iterator, Mapping

from qtool.errors import CheckpointError

__all__ = ["TRUST", "collected", "refuse_folder_code", "auto_tokenizer", "tokenizer_panics", "NOTE_LIMIT"]

TRUST = False  # trust_remote_code, at every transformers entry point
NOTE_LIMIT = 8  # distinct notes kept from one call: a message repeated per layer is one note
_LOGGERS = ("transformers", "torch", "tokenizers", "huggingface_hub")
_HINT = "qtool never runs a model folder's own code; use a folder whose architecture and tokenizer transformers has built in"


@contextlib.contextmanager
def collected(notes: list[str], prefix: str = "") -> Iterator[None]:
    """For the length of the block, transformers', torch's and the Hub client's log records
    (WARNING and above) and Python warnings become `notes` (at most NOTE_LIMIT distinct, whitespace
    folded, each cut to 300 characters), and nothing of theirs is written to stderr. The loggers'
    handlers and propagation, and the warnings filters, are put back afterwards."""
    seen = set(notes)

    def note(text: str) -> None:
        line = prefix + " ".join(str(text).split())[:300]
        if line not in seen and len(seen) < NOTE_LIMIT:
            seen.add(line)
            notes.append(line)

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                try:
                    note(record.getMessage())
                except Exception:
                    note(str(record.msg))

    handler = Collect()
    saved = []
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers[:], logger.propagate))
        logger.handlers[:] = [handler]
        logger.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, category, *_, **__: note(f"{category.__name__}: {message}")
            yield
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers[:] = handlers
            logger.propagate = propagate


def _auto_map(value: Any) -> dict[str, Any]:
    """A config's `auto_map` as a dict of auto class to reference(s); the legacy list form (a
    tokenizer's [slow, fast]) as AutoTokenizer's."""
    auto_map = value.get("auto_map") if isinstance(value, Mapping) else None
    if isinstance(auto_map, Mapping):
        return dict(auto_map)
    if isinstance(auto_map, (list, tuple)):
        return {"AutoTokenizer": list(auto_map)}
    return {}


def _shown(reference: Any) -> str:
    """One auto_map entry as the message names it (the folder's own text: the CLI escapes it)."""
    if isinstance(reference, (list, tuple)):
        reference = next((r for r in reference if isinstance(r, str)), "")
    return str(reference)[:120]  # quoted raw: the CLI escapes it once


def code_refusal(file: str, auto_class: str, reference: Any, what: str) -> CheckpointError:
    """The one-line refusal of a folder whose `file` names its own code for `auto_class`."""
    return CheckpointError(
        f"names its own code for {what} (auto_map {auto_class}: '{_shown(reference)}'), and qtool never runs a model folder's code",
        path=file, hint=_HINT,
    )  # fmt: skip


def refuse_folder_code(folder: str, config: Mapping[str, Any] | None, *, known_model_type: bool) -> None:
    """Refuse a model folder whose config.json names its own code for an architecture
    transformers does not have (`known_model_type` False: an unknown `model_type`, or none)."""
    auto_map = _auto_map(config)
    if not auto_map or known_model_type:
        return  # a known model_type: transformers builds its own class and never asks
    auto_class = next(
        (k for k in ("AutoModelForCausalLM", "AutoConfig", "AutoModel") if k in auto_map), next(iter(auto_map))
    )
    raise code_refusal(os.path.join(folder, "config.json"), auto_class, auto_map[auto_class], "its architecture")


def _tokenizer_config(path: str) -> dict[str, Any]:
    """tokenizer_config.json of the folder, read as qtool reads any side file; {} when absent or
    not a JSON object (transformers says what is wrong with it)."""
    from qtool.formats.regular_files import NotReadable, read_regular
    from qtool.formats.untrusted_json import MAX_JSON_BYTES, parse_json

    file = os.path.join(path, "tokenizer_config.json")
    try:
        raw = read_regular(file, MAX_JSON_BYTES)
    except (NotReadable, OSError):
        return {}
    try:
        value = parse_json(raw, file)
    except CheckpointError:
        return {}
    return value if isinstance(value, dict) else {}


def auto_tokenizer(path: str, shown: str, notes: list[str]) -> Any:
    """transformers' AutoTokenizer of the folder `path` (local files only, its code never
    trusted, its talk collected into `notes`). A tokenizer that exists only as the folder's own
    code is a CheckpointError naming `shown`'s tokenizer_config.json (or config.json); anything
    else transformers raises is the caller's to word."""
    from transformers import AutoTokenizer

    try:
        with collected(notes, "tokenizer: "):
            return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=TRUST)
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        auto_map = _auto_map(_tokenizer_config(path))
        if "AutoTokenizer" in auto_map:
            raise code_refusal(
                os.path.join(shown, "tokenizer_config.json"),
                "AutoTokenizer",
                auto_map["AutoTokenizer"],
                "its tokenizer",
            ) from None
        raise CheckpointError(
            "names its own code for its tokenizer (auto_map), and qtool never runs a model folder's code",
            path=os.path.join(shown, "config.json"),
            hint=_HINT,
        ) from None


def _is_panic(exc: BaseException) -> bool:
    """pyo3's PanicException: its module is `pyo3_runtime`, which cannot be imported by name."""
    return type(exc).__name__ == "PanicException"


@contextlib.contextmanager
def tokenizer_panics(tokenizer_file: str) -> Iterator[None]:
    """A panic in the Rust tokenizer while the block runs (a pre-tokenizer regex that
    backtracks past its limit) is a CheckpointError naming `tokenizer_file`."""
    try:
        yield
    except BaseException as exc:
        if not _is_panic(exc):
            raise
        detail = " ".join(str(exc).split())[:200] or "no message"
        raise CheckpointError(
            f"the tokenizer failed on the text ({detail})",
            path=tokenizer_file,
            hint="a pre-tokenizer or normalizer regex that backtracks; fix or replace the tokenizer",
        ) from None
