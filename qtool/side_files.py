"""Which of a model folder's small files a written checkpoint carries over.

Only the model's own files travel: its tokenizer, generation config and processor configs,
by name (config.json is rewritten by the layout, not copied). Nothing else in the folder
(notes, logs, other checkpoints) is published with the output. A file input carries nothing:
the layout writes config.json from the one beside it.

A symlinked side file is followed only to a regular file inside the model folder, or, for a
Hugging Face cache snapshot (`models--org--name/snapshots/<rev>/x -> ../../blobs/<hash>`),
inside the same repository's `blobs/`. A link anywhere else (`tokenizer.json -> /etc/passwd`)
is skipped with a warning: its contents must never end up in an output meant for publishing.

The check before the run names what is skipped; the copy itself (`read_carried`) opens each file
once and checks the descriptor (qtool.formats.regular_files), so a file swapped for a link, a
FIFO or a device after the check is refused, never published and never waited on.
"""

from __future__ import annotations

import fnmatch
import os
import stat

from qtool.errors import CheckpointError
from qtool.formats.checkpoint import Checkpoint
from qtool.formats.regular_files import NotReadable, read_regular

__all__ = ["SIDE_FILE_PATTERNS", "SIDE_FILE_LIMIT", "carried_over", "skipped_links", "linked_out", "read_carried"]

SIDE_FILE_LIMIT = 64 << 20  # a tokenizer is a few MB; anything larger is not a side file
SIDE_FILE_PATTERNS = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tokenizer*.txt", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece*.model",
    "*.tiktoken", "generation_config.json", "chat_template.json", "chat_template.jinja",
    "preprocessor_config.json", "processor_config.json",
)  # fmt: skip


def _roots(folder: str) -> list[str]:
    """Where a side file of `folder` may resolve: the folder, and a cache repository's blobs."""
    real = os.path.realpath(folder)
    roots = [real]
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def _candidates(source: Checkpoint) -> list[tuple[str, str]]:
    if not os.path.isdir(source.path):
        return []
    names = sorted(os.listdir(source.path))
    return [
        (os.path.join(source.path, name), name)
        for name in names
        if any(fnmatch.fnmatchcase(name, p) for p in SIDE_FILE_PATTERNS)
    ]


def _safe(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    try:
        info = os.stat(real)
    except OSError:
        return False
    return _inside(real, roots) and stat.S_ISREG(info.st_mode) and info.st_size <= SIDE_FILE_LIMIT


def carried_over(source: Checkpoint) -> list[tuple[str, str]]:
    """(path, name) of every side file to copy from `source`'s folder."""
    roots = _roots(source.path) if os.path.isdir(source.path) else []
    return [(path, name) for path, name in _candidates(source) if _safe(path, roots)]


def skipped_links(source: Checkpoint) -> list[str]:
    """Side files left behind because they are links out of the model's folder (or not
    regular files): what the warning names."""
    roots = _roots(source.path) if os.path.isdir(source.path) else []
    return [name for path, name in _candidates(source) if not _safe(path, roots)]


def linked_out(path: str) -> bool:
    """Whether `path` is a link that resolves out of its folder (an HF cache's blobs aside)."""
    return os.path.islink(path) and not _inside(os.path.realpath(path), _roots(os.path.dirname(os.path.abspath(path))))


def read_carried(source: Checkpoint, path: str) -> bytes:
    """The bytes of side file `path` (one `carried_over` named), read through one descriptor:
    opened without following a last link, without blocking, then checked to be a regular file
    inside the model folder (or the cache's blobs) within SIDE_FILE_LIMIT. A file that no
    longer passes is a CheckpointError: the output is abandoned, nothing is published."""
    roots = tuple(_roots(source.path))
    real = os.path.realpath(path)
    try:
        if not _inside(real, list(roots)):
            raise NotReadable("it links out of the model folder")
        content = read_regular(real, SIDE_FILE_LIMIT, follow=False, inside=roots)
        if len(content) > SIDE_FILE_LIMIT:
            raise NotReadable(f"it is larger than {SIDE_FILE_LIMIT} bytes")
        return content
    except NotReadable as exc:
        raise CheckpointError(f"side file changed while qtool ran: {exc}; nothing was written", path=path) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror}", path=path) from None
