"""Where outputs are staged, and how they are moved into place without replacing anything.

Everything qtool writes is first written under a staging name beside its target, in the same
folder (so the final rename stays on one filesystem and is atomic):

    .{basename}.qtool-tmp-{pid}-{start}-{host}-{random}

- `pid` and `start` (the process's start time in clock ticks, /proc/PID/stat field 22) name the
  run that owns the entry. A pid alone is reused; a pid with the same start time is not.
- `host` is 8 hex digits of a hash of the hostname and the pid namespace. A pid means nothing
  in another namespace or on another machine sharing the folder (NFS), so entries with another
  `host` are never removed: their owner may be alive where we cannot see it.
- `random` keeps two staging names of one process apart.

`cleanup_stale` removes the entries whose owner is dead, so a SIGKILLed run's temporary files
go away on the next run. Names from older qtool versions (mkdtemp's random suffix) carry no
owner, so they are left alone.

A live registry of this process's staging paths lets `abort_all` (atexit, and a SIGTERM
handler) remove them. A path is registered *before* it is created, so an interrupt between the
two leaks nothing; removing a path that was never created is a no-op.

Moving into place never replaces what appeared meanwhile: `renameat2(RENAME_NOREPLACE)`, with
fallbacks where the filesystem lacks it (see `rename_noreplace`). Replacing an existing output
(`--overwrite`) swaps it with `RENAME_EXCHANGE`, so the target never disappears, and checks that
what it displaced is the output that was checked before writing; without EXCHANGE, the old one
is moved aside under a `.qtool-old-` name that `cleanup_stale` puts back if the run dies before
the new one is in place.

Files and folders are created with modes 0o666 and 0o777: the kernel applies the umask (and a
default ACL, where the folder has one), so the umask is never read, and never set, which would
race with other threads.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import os
import shutil
import stat
import sys
import threading
from fnmatch import fnmatchcase
from collections.abc import Callable

from qtool import libc
from qtool.errors import CheckpointError, UsageError

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "CHECKPOINT_FILES",
    "staging_path",
    "register",
    "remove",
    "abort_all",
    "cleanup_stale",
    "rename_noreplace",
    "place",
    "make_parents",
    "remove_created",
    "check_replaceable",
]

TMP_MARK = ".qtool-tmp-"
OLD_MARK = ".qtool-old-"
_NAME_MAX = 255  # bytes in one path component on every Linux filesystem qtool writes to

CHECKPOINT_SUFFIXES = (".safetensors", ".gguf")  # what a single-file output may replace

# What a folder output may replace: a folder holding these names only, and no subfolder: weights
# and their index, configs and tokenizer files, what qtool writes and carries over. A model card,
# a licence or code (README.md, LICENSE, modeling_*.py) may have been written by hand, so a
# folder holding them is refused rather than replaced.
CHECKPOINT_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.gguf",
    "pytorch_model*.bin",
    "*.bin.index.json",
    "config.json",
    "*_config.json",  # generation_, quantize_, quantization_, preprocessor_, processor_, adapter_
    "params.json",
    "quanto_qmap.json",
    "quantization_map.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",  # sentencepiece
    "*.tiktoken",
    "chat_template.*",
)


# -- who owns a staging name ---------------------------------------------------------------------


def _process_start(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat, the start time in clock ticks after boot; None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read()
        return int(raw[raw.rindex(b")") + 2 :].split()[19])  # fields after "(comm) " start at 3
    except (OSError, ValueError, IndexError):
        return None


def _host_tag() -> str:
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return _sha1(f"{_host_name()}\0{namespace}".encode()).hexdigest()[:8]


def _sha1(data: bytes):
    """hashlib.sha1, from CPython's own small module where it has one: importing hashlib loads
    OpenSSL, ~2-3 ms of a 0.5 s GGUF requantize's start-up (as did secrets, through hmac)."""
    try:
        from _sha1 import sha1
    except ImportError:
        from hashlib import sha1
    return sha1(data)


def _host_name() -> str:
    """gethostname(), by uname where there is one: the socket module costs ~10 ms to import."""
    if hasattr(os, "uname"):
        return os.uname().nodename
    import socket

    return socket.gethostname()


_HOST = _host_tag()
_owner_cache: tuple[int, str] | None = None


def _owner() -> str:
    """`{pid}-{start}-{host}` of this process (recomputed after a fork: the pid changed)."""
    global _owner_cache
    pid = os.getpid()
    if _owner_cache is None or _owner_cache[0] != pid:
        _owner_cache = (pid, f"{pid}-{_process_start(pid) or 0}-{_HOST}")
    return _owner_cache[1]


def _alive(pid: int, start: int) -> bool:
    """Whether process `pid`, started at `start`, still runs. Where /proc does not show it
    (another user's process under hidepid), a signal-0 probe decides, and "exists" counts as
    alive: never remove what might be in use."""
    actual = _process_start(pid)
    if actual is not None:
        return actual == start or start == 0
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _parse(name: str) -> tuple[str, int, int, str] | None:
    """(mark, pid, start, host) of a staging or aside name; None for any other name."""
    if not name.startswith("."):
        return None
    for mark in (TMP_MARK, OLD_MARK):
        _, found, tail = name.rpartition(mark)
        if found:
            parts = tail.split("-")
            if len(parts) == 4 and parts[0].isdigit() and parts[1].isdigit():
                return mark, int(parts[0]), int(parts[1]), parts[2]
    return None


def _truncate(text: str, limit: int) -> str:
    """`text` cut to at most `limit` bytes of UTF-8 (or of the surrogate-escaped bytes)."""
    raw = os.fsencode(text)
    return text if len(raw) <= limit else os.fsdecode(raw[: max(limit, 0)])


def staging_path(target: str, mark: str = TMP_MARK) -> str:
    """A fresh staging name beside `target`, owned by this process (nothing is created). The
    basename is cut to fit 255 bytes; an aside (OLD_MARK) must carry it whole, for
    cleanup_stale to put it back, so a name too long for that becomes a plain staging name."""
    parent, base = os.path.split(target)
    tail = f"{mark}{_owner()}-{os.urandom(4).hex()}"  # secrets.token_hex(4)
    room = _NAME_MAX - 1 - len(tail)
    if mark == OLD_MARK and len(os.fsencode(base)) > room:
        return staging_path(target, TMP_MARK)
    return os.path.join(parent, f".{_truncate(base, room)}{tail}")


# -- this process's live staging paths -----------------------------------------------------------

# path -> (pid that registered it, where to put it back: an aside holds a previous output,
# a descriptor of the folder it was made in: removed there even after that folder moved)
_live: dict[str, tuple[int, str | None, int | None]] = {}
# Reentrant: a SIGTERM handler calling abort_all runs in the main thread, maybe while it holds this.
_lock = threading.RLock()


_hooks_installed = False


def _folder_descriptor(path: str) -> int | None:
    """A descriptor of the folder `path` is in (None where it cannot be opened: then the path's
    name is all there is to remove it by)."""
    try:
        return os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None


def register(path: str, restore_to: str | None = None) -> None:
    """Mark `path` as ours to remove on abort (or, with `restore_to`, to rename back there).
    The first registration installs the process hooks (exit cleanup, and forgetting the paths in
    a forked child): a program that imports qtool but never writes gets none."""
    global _hooks_installed
    folder = _folder_descriptor(path) if restore_to is None else None
    with _lock:
        if not _hooks_installed:
            atexit.register(abort_all)
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_forget_after_fork)
            _hooks_installed = True
        previous = _live.get(path)
        _live[path] = (os.getpid(), restore_to, folder)
    if previous is not None:
        _close(previous[2])


def _close(folder: int | None) -> None:
    if folder is not None:
        try:
            os.close(folder)
        except OSError:
            pass


def _unregister(path: str) -> None:
    with _lock:
        entry = _live.pop(path, None)
    if entry is not None:
        _close(entry[2])


def _delete(path: str, folder: int | None = None) -> None:
    """Delete `path`, by its name within `folder` where a descriptor of it is held: the output's
    parent renamed during a run then still loses its staged files, wherever it went."""
    name, where = (os.path.basename(path), folder) if folder is not None else (path, None)
    try:
        if stat.S_ISDIR(os.lstat(name, dir_fd=where).st_mode):
            if where is None or sys.version_info >= (3, 11):
                shutil.rmtree(name, dir_fd=where)
            else:  # Python 3.10's rmtree takes no dir_fd: Linux's name for the descriptor's folder
                shutil.rmtree(f"/proc/self/fd/{where}/{name}")
        else:
            os.unlink(name, dir_fd=where)
    except FileNotFoundError:
        pass


def remove(path: str) -> None:
    """Delete a registered path (a folder with its contents), then forget it. Best effort."""
    with _lock:
        entry = _live.get(path)
    folder = entry[2] if entry is not None and entry[0] == os.getpid() else None
    try:
        _delete(path, folder)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
    _unregister(path)


def abort_all() -> None:
    """Remove every staging path this process still holds, and put back any previous output
    that was moved aside. For atexit and for a SIGTERM handler; safe to call twice."""
    with _lock:
        entries = [(path, restore_to) for path, (pid, restore_to, _) in _live.items() if pid == os.getpid()]
    for path, restore_to in entries:
        if restore_to is None:
            remove(path)
            continue
        try:
            rename_noreplace(path, restore_to)
        except OSError:  # the target is taken: the aside stays for cleanup_stale to decide
            pass
        _unregister(path)


def _forget_after_fork() -> None:
    """A forked child owns none of its parent's staging paths, and another thread may have held
    the lock at the fork. Their folder descriptors are the child's copies: closed."""
    global _lock
    _lock = threading.RLock()
    for _, _, folder in _live.values():
        _close(folder)
    _live.clear()


def cleanup_stale(parent: str) -> list[str]:
    """Remove the staging entries in `parent` whose owner is dead; return their paths.

    An entry owned by a live process, or by another host or pid namespace, is left alone. A
    `.qtool-old-` aside (a previous output moved out of the way by a run that died before its
    new output was in place) is renamed back when its target is free, else removed."""
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        parsed = _parse(name)
        if parsed is None:
            continue
        mark, pid, start, host = parsed
        if host != _HOST or _alive(pid, start):
            continue
        path = os.path.join(parent, name)
        if mark == OLD_MARK:
            original = os.path.join(parent, name[1 : name.rindex(OLD_MARK)])
            try:
                rename_noreplace(path, original)
                continue
            except OSError:
                pass
        try:
            _delete(path)
        except OSError:
            continue  # not ours to fight over: permissions, or another run removing it too
        removed.append(path)
    return removed


# -- moving into place ---------------------------------------------------------------------------

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_renameat2 = libc.function("renameat2", (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint))
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def _rename2(source: str, target: str, flags: int) -> bool:
    """renameat2 with `flags`: True when done, False when this kernel, libc or filesystem has
    no such call or flag; any other failure raises OSError."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    error = ctypes.get_errno()
    if error in _UNSUPPORTED:
        return False
    raise OSError(error, os.strerror(error), source, None, target)


def rename_noreplace(source: str, target: str) -> None:
    """Rename `source` to `target`; FileExistsError if `target` exists, whatever it is.

    renameat2(RENAME_NOREPLACE) where the filesystem has it (ext4, xfs, btrfs, tmpfs, ...).
    Elsewhere, for a file: link() then unlink(), where link fails on an existing name. For a
    folder: mkdir() claims the name (it fails on an existing one), then rename() replaces the
    claim, which rename allows only while it is an empty folder. The one thing that can be
    replaced is an empty folder put there between the two calls. A filesystem with neither
    hard links nor RENAME_NOREPLACE (vfat) gets a check right before a plain rename: a race of
    microseconds, the best it allows."""
    if _rename2(source, target, _RENAME_NOREPLACE):
        return
    if os.path.isdir(source) and not os.path.islink(source):
        os.mkdir(target, 0o700)  # FileExistsError if taken
        try:
            os.rename(source, target)
        except BaseException as exc:
            try:
                os.rmdir(target)
            except OSError:
                pass
            if isinstance(exc, OSError) and exc.errno in (errno.ENOTEMPTY, errno.EEXIST):  # the claim was filled
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), target) from None
            raise
        return
    try:
        os.link(source, target, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), target) from None
        os.rename(source, target)
        return
    os.unlink(source)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _appeared(shown: str) -> UsageError:
    return UsageError(
        f"output {shown} appeared while writing; nothing was replaced",
        hint="another run may be writing there; choose another output path",
        option="output",
    )


def _changed(shown: str) -> UsageError:
    return UsageError(
        f"output {shown} changed while writing; nothing was replaced",
        hint="another run may be writing there; choose another output path",
        option="output",
    )


def place(
    source: str, target: str, *, shown: str, replacing: tuple[int, int] | None, check: Callable[[str], None]
) -> str | None:
    """Move the finished `source` to `target`, never replacing anything but the output that was
    checked before writing (`replacing`: its (st_dev, st_ino); None when there was none).
    `check(path)` raises UsageError if what now lies at `path` may not be replaced (a folder
    that gained other files meanwhile). Returns where the replaced output now lies, for the
    caller to delete; None when nothing was replaced. Raises UsageError, and leaves the target
    as it was, when something appeared or changed there meanwhile."""

    def is_expected(path: str) -> bool:
        if _identity(path) != replacing:
            return False
        try:
            check(path)
        except (UsageError, OSError):
            return False
        return True

    if replacing is not None:
        try:
            swapped = _rename2(source, target, _RENAME_EXCHANGE)
        except FileNotFoundError:  # the old output vanished meanwhile: nothing left to replace
            swapped = None
        if swapped:
            if is_expected(source):
                return source
            _rename2(source, target, _RENAME_EXCHANGE)  # swap back: the target is as it was
            raise _changed(shown)
        if swapped is False:
            aside = _move_aside(target, is_expected, shown)
            if aside is not None:
                _move_in(source, target, aside, shown)
                return aside
    try:
        rename_noreplace(source, target)
    except FileExistsError:
        raise _appeared(shown) from None
    return None


def _move_aside(target: str, is_expected: Callable[[str], bool], shown: str) -> str | None:
    """`place` without RENAME_EXCHANGE, step one: move the old output to an aside name that is
    registered to be put back (by abort_all here, or by cleanup_stale after a SIGKILL). None
    when the target vanished meanwhile."""
    aside = staging_path(target, OLD_MARK)
    register(aside, restore_to=target)
    try:
        os.rename(target, aside)
    except FileNotFoundError:
        _unregister(aside)
        return None
    if not is_expected(aside):
        _put_back(aside, target)
        raise _changed(shown)
    return aside


def _move_in(source: str, target: str, aside: str, shown: str) -> None:
    """Step two: the new output in, with no-replace; only then is the old one to delete. On any
    failure the old one goes back."""
    try:
        rename_noreplace(source, target)
    except BaseException as exc:
        _put_back(aside, target)
        if isinstance(exc, FileExistsError):
            raise _appeared(shown) from None
        raise
    register(aside)


def _put_back(aside: str, target: str) -> None:
    try:
        rename_noreplace(aside, target)
        _unregister(aside)
    except OSError:
        pass  # the target is taken: the aside stays registered, for abort_all or cleanup_stale


# -- before writing: the target's folder, and what may be replaced --------------------------------


def make_parents(folder: str, shown: str, what: str = "output") -> list[str]:
    """Create `folder` and its missing ancestors (mode 0o777, less the umask); return the ones
    created, outermost first, so an aborted run can remove them again. A component that exists
    and is not a folder is a UsageError that names it."""
    try:
        if stat.S_ISDIR(os.stat(folder).st_mode):
            return []
    except OSError:
        pass
    created: list[str] = []
    parts = os.path.abspath(folder).split(os.sep)
    path = os.sep
    for part in parts[1:]:
        if not part:
            continue
        path = os.path.join(path, part)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if os.path.islink(path):
                raise UsageError(f"cannot create {what} {shown}: {path} is a broken symlink") from None
            try:
                os.mkdir(path, 0o777)
                created.append(path)
                continue
            except FileExistsError:  # another run made it meanwhile
                st = os.stat(path)
            except OSError as exc:
                remove_created(created)
                raise CheckpointError(
                    f"cannot create {what} {shown}: cannot create {path}: {exc.strerror or exc}"
                ) from None
        except OSError as exc:
            remove_created(created)
            raise CheckpointError(f"cannot create {what} {shown}: {path}: {exc.strerror or exc}") from None
        if not stat.S_ISDIR(st.st_mode):
            remove_created(created)
            raise UsageError(
                f"cannot create {what} {shown}: {path} is a file", hint="choose another output path", option="output"
            )
    return created


def remove_created(created: list[str]) -> None:
    """Remove folders `make_parents` created, innermost first, where they are still empty."""
    for path in reversed(created):
        try:
            os.rmdir(path)
        except OSError:
            pass


def _show(name: str) -> str:
    """A file name for a one-line message: control characters escaped."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in name)


def check_replaceable(target: str, shown: str, *, single_file: bool, name: str | None = None) -> None:
    """Raise UsageError unless `--overwrite` may replace what is at `target`: for a single-file
    output a regular file with a checkpoint suffix, for a folder output a folder that holds
    checkpoint files only (CHECKPOINT_FILES; no subfolders). A symlink is refused either way:
    replacing the link would not touch what it points to. `name`: the name whose suffix counts,
    when `target` is that file moved aside under another name."""
    st = os.lstat(target)
    refuse = "refusing to replace it"
    if stat.S_ISLNK(st.st_mode):
        raise UsageError(
            f"output {shown} is a symlink; {refuse}",
            hint="write to the path it points to, or choose another output path",
            option="output",
        )
    if single_file:
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(
                f"output {shown} is a folder, and this output is one file; {refuse}",
                hint="choose another output path",
                option="output",
            )
        if not stat.S_ISREG(st.st_mode) or not (name or target).endswith(CHECKPOINT_SUFFIXES):
            raise UsageError(
                f"output {shown} is not a checkpoint file ({', '.join(CHECKPOINT_SUFFIXES)}); {refuse}",
                hint="choose another output path",
                option="output",
            )
        return
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(
            f"output {shown} is a file, and this output is a folder; {refuse}",
            hint="choose another output path",
            option="output",
        )
    unexpected = []
    with os.scandir(target) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                unexpected.append(entry.name + "/")
            elif (entry.is_file(follow_symlinks=False) or entry.is_symlink()) and any(
                fnmatchcase(entry.name, p) for p in CHECKPOINT_FILES
            ):
                continue
            else:
                unexpected.append(entry.name)
    if unexpected:
        unexpected.sort()
        listed = ", ".join(_show(name) for name in unexpected[:5])
        if len(unexpected) > 5:
            listed += f" and {len(unexpected) - 5} more"
        raise UsageError(
            f"output {shown} holds {listed}, which are not checkpoint files; {refuse}",
            hint="overwrite replaces only a previous checkpoint folder; choose another output",
            option="overwrite",
        )
