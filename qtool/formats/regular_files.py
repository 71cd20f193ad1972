"""Reading a small file from a stranger's folder through one checked descriptor.

A path checked and then opened again can be swapped in between (a symlink out of the folder, a
FIFO that blocks `open()` for good, `/dev/zero` that never ends). So the file is opened once,
without blocking, and the descriptor itself is checked: a regular file, the same device and
inode as the one checked beforehand where there was one; and at most limit + 1 bytes are read,
so the caller sees a file over the limit (or one growing past it meanwhile) without holding it.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["NotReadable", "open_regular", "read_regular", "read_descriptor", "descriptor_path"]

_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
_CHUNK = 1 << 20


class NotReadable(Exception):
    """Why a file was not read (a short phrase for the caller's message)."""


def descriptor_path(fd: int) -> str | None:
    """The kernel's own path of an open descriptor (Linux), or None where it cannot say."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def open_regular(
    path: str, *, follow: bool = True, expect: os.stat_result | None = None, inside: tuple[str, ...] = ()
) -> tuple[int, os.stat_result]:
    """A blocking descriptor of the regular file `path`, checked, and its stat; the caller
    closes it. For a file read in pieces (a calibration text, an importance matrix): the
    checks of `read_regular`, and nothing read yet.

    follow: whether a symlink as the last component is followed (False: O_NOFOLLOW).
    expect: the stat of the file checked earlier; a different device or inode is refused.
    inside: folders the descriptor's real path must lie in (checked where the kernel says).
    Raises NotReadable with the reason."""
    flags = _FLAGS | (0 if follow else getattr(os, "O_NOFOLLOW", 0))
    try:
        fd = os.open(path, flags)  # O_NONBLOCK: a FIFO with no writer opens at once, and is refused below
    except OSError as exc:
        raise NotReadable(
            "it is a link" if exc.errno == errno.ELOOP and not follow else exc.strerror or "cannot open"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotReadable("it is not a regular file")
        if expect is not None and (info.st_dev, info.st_ino) != (expect.st_dev, expect.st_ino):
            raise NotReadable("it was replaced while qtool ran")
        if inside:
            real = descriptor_path(fd)
            if real is not None and not any(
                real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in inside
            ):
                raise NotReadable("it links out of the model folder")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def read_descriptor(fd: int, limit: int) -> bytes:
    """From `fd`'s position, at most `limit` + 1 bytes (fewer at the end of the file)."""
    pieces: list[bytes] = []
    left = limit + 1
    while left > 0:
        piece = os.read(fd, min(left, _CHUNK))
        if not piece:
            break
        pieces.append(piece)
        left -= len(piece)
    return b"".join(pieces)


def read_regular(
    path: str, limit: int, *, follow: bool = True, expect: os.stat_result | None = None, inside: tuple[str, ...] = ()
) -> bytes:
    """The bytes of the regular file `path`, at most `limit` + 1 of them (more than `limit`
    means the file is over it: the caller says so in its own words). The checks and arguments
    are `open_regular`'s. Raises NotReadable with the reason; OSError only for a failing read."""
    fd, info = open_regular(path, follow=follow, expect=expect, inside=inside)
    try:
        return read_descriptor(fd, min(limit, info.st_size))  # one byte over: the file is (or grew) past the limit
    finally:
        os.close(fd)
