"""Which revision a checkpoint on disk is, so a report can say which commit it measured:

    .../models--ORG--NAME/snapshots/<commit>/...    a Hugging Face cache snapshot: ORG/NAME at <commit>
    a path inside a git work tree                   that work tree's HEAD commit (and branch)

Read from the files themselves, never by running git: `.git` (a folder, or a file
`gitdir: ...` in a linked work tree), `HEAD`, a loose ref or `packed-refs`. Every file is read
through one checked descriptor (`regular_files.read_regular`: a FIFO as `.git/HEAD` is never
waited on, a link to /dev/zero never read), capped in size, and every value checked (a commit
is 40 or 64 hex digits); anything unexpected means "unknown" (None), never an error: a
revision is a courtesy in a report, not an input.
"""

from __future__ import annotations

import os
import re

from qtool.formats.regular_files import NotReadable, read_regular

__all__ = ["revision_of"]

_COMMIT = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")
_HUB_REPO = re.compile(r"models--([^/]+?)--(.+)")  # the cache's folder name: models--ORG--NAME (ORG has no --)
_SMALL = 4096  # HEAD, a loose ref, a gitdir pointer
_PACKED_REFS_MAX = 16 << 20
_MAX_DEPTH = 64  # parent folders searched for a .git


def _read(path: str, limit: int) -> str | None:
    try:
        data = read_regular(path, limit)
    except (NotReadable, OSError):
        return None
    if len(data) > limit:
        return None
    return data.decode("utf-8", "replace")


def _hub(parts: list[str]) -> dict[str, str] | None:
    for at in range(len(parts) - 2):
        repo = _HUB_REPO.fullmatch(parts[at])
        if repo and parts[at + 1] == "snapshots" and _COMMIT.fullmatch(parts[at + 2]):
            return {"source": "hub-cache", "repo": f"{repo.group(1)}/{repo.group(2)}", "commit": parts[at + 2]}
    return None


def _git_dir(folder: str) -> str | None:
    dot_git = os.path.join(folder, ".git")
    if os.path.isdir(dot_git):
        return dot_git
    text = _read(dot_git, _SMALL) if os.path.isfile(dot_git) else None
    if text and text.startswith("gitdir: "):
        pointed = text[len("gitdir: ") :].strip()
        pointed = pointed if os.path.isabs(pointed) else os.path.join(folder, pointed)
        return pointed if os.path.isdir(pointed) else None
    return None


def _resolve_ref(git_dir: str, ref: str) -> str | None:
    if not re.fullmatch(r"refs/[A-Za-z0-9._/-]{1,240}", ref) or ".." in ref:
        return None
    common = git_dir
    pointer = _read(os.path.join(git_dir, "commondir"), _SMALL)  # a linked work tree's shared refs
    if pointer:
        common = os.path.normpath(os.path.join(git_dir, pointer.strip()))
    for base in dict.fromkeys((git_dir, common)):
        loose = _read(os.path.join(base, ref), _SMALL)
        if loose and _COMMIT.fullmatch(loose.strip()):
            return loose.strip()
    packed = _read(os.path.join(common, "packed-refs"), _PACKED_REFS_MAX) or ""
    for line in packed.splitlines():
        commit, _, name = line.partition(" ")
        if name == ref and _COMMIT.fullmatch(commit):
            return commit
    return None


def _git(folder: str) -> dict[str, str | None] | None:
    for _ in range(_MAX_DEPTH):
        git_dir = _git_dir(folder)
        if git_dir is not None:
            head = (_read(os.path.join(git_dir, "HEAD"), _SMALL) or "").strip()
            if _COMMIT.fullmatch(head):
                return {"source": "git", "repo": None, "commit": head, "ref": None}
            if head.startswith("ref: "):
                ref = head[len("ref: ") :]
                commit = _resolve_ref(git_dir, ref)
                if commit:
                    return {"source": "git", "repo": None, "commit": commit, "ref": ref}
            return None
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent
    return None


def revision_of(path: str) -> dict[str, str | None] | None:
    """{"source": "hub-cache" | "git", "repo": "ORG/NAME" | None, "commit": hex, ...} for a
    local checkpoint path, or None when its revision is not known (or it is remote)."""
    if "://" in path or not os.path.exists(path):
        return None
    absolute = os.path.abspath(path)  # not realpath: a Hub snapshot's files link into blobs/
    found = _hub(absolute.split(os.sep))
    if found is not None:
        return found
    return _git(absolute if os.path.isdir(absolute) else os.path.dirname(absolute))
