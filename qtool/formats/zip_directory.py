"""A zip archive's central directory, read without inflating anything (CONVENTIONS §9).

`torch.save` (since PyTorch 1.6) writes a zip: `<root>/data.pkl`, one uncompressed record
`<root>/data/<key>` per storage, and small records (`byteorder`, `version`). qtool needs the
directory (names, sizes, where each member's bytes start) and one small member inflated, so it
reads the end-of-central-directory record and the directory itself, nothing else:

- Every size comes from the directory and is checked against the file before use: a member's
  bytes lie inside the file, the directory is at most `DIRECTORY_LIMIT` bytes.
- `read_member` inflates with a cap: a member the directory says is larger than the cap is
  refused unread, and inflating stops at the declared size (a zip bomb's 1.5 GB `data.pkl`
  costs nothing), then the CRC-32 is checked.
- A member's data offset comes from its local header (30 bytes read), on demand.

Zip64 (archives over 4 GiB, what torch writes for large models) is read; multi-disk archives
and encryption are refused. Errors are `ZipError` (a ValueError) with one line of text; the
caller names the file.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass

__all__ = ["ZipError", "ZipMember", "ZipDirectory", "DIRECTORY_LIMIT", "is_zip"]

DIRECTORY_LIMIT = 64 << 20  # bytes of central directory: about a million members
_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_STORED, _DEFLATED = 0, 8
_CHUNK = 1 << 20


class ZipError(ValueError):
    """The archive is damaged, or uses a zip feature qtool does not read."""


@dataclass(frozen=True)
class ZipMember:
    name: str
    method: int  # 0 stored, 8 deflated
    flags: int
    crc: int
    compressed_size: int
    size: int
    header_offset: int  # where its local header starts

    @property
    def stored(self) -> bool:
        return self.method == _STORED


def is_zip(head: bytes) -> bool:
    return head[:4] in (_LOCAL, _EOCD)


class ZipDirectory:
    """The members of a zip archive, from its central directory. `fd` stays the caller's."""

    def __init__(self, fd: int, file_size: int) -> None:
        self.fd = fd
        self.file_size = file_size
        self.members: dict[str, ZipMember] = {}
        self.order: list[str] = []
        self._data_offsets: dict[str, int] = {}
        self._read_directory()

    # -- the directory ----------------------------------------------------------------------------

    def _pread(self, size: int, offset: int) -> bytes:
        if offset < 0 or size < 0 or offset + size > self.file_size:
            raise ZipError(f"reaches past the end of the file (bytes {offset}..{offset + size} of {self.file_size})")
        data = os.pread(self.fd, size, offset)
        if len(data) != size:
            raise ZipError(f"is cut short at byte {offset + len(data)} (truncated while it was read?)")
        return data

    def _read_directory(self) -> None:
        tail_size = min(self.file_size, 22 + 0xFFFF)
        tail = self._pread(tail_size, self.file_size - tail_size)
        at = tail.rfind(_EOCD)
        while at >= 0 and at + 22 > len(tail):
            at = tail.rfind(_EOCD, 0, at)
        if at < 0:
            raise ZipError("has no end-of-central-directory record: a truncated or damaged zip archive")
        eocd_offset = self.file_size - tail_size + at
        disk, cd_disk, _, entries, cd_size, cd_offset, _ = struct.unpack("<HHHHIIH", tail[at + 4 : at + 22])
        if 0xFFFF in (entries,) or 0xFFFFFFFF in (cd_size, cd_offset):
            entries, cd_size, cd_offset, disk, cd_disk = self._zip64(eocd_offset)
        if disk != 0 or cd_disk != 0:
            raise ZipError("is a multi-disk zip archive, which qtool does not read")
        if cd_size > DIRECTORY_LIMIT:
            raise ZipError(f"has a {cd_size}-byte central directory, over qtool's limit of {DIRECTORY_LIMIT}")
        if cd_offset + cd_size > eocd_offset:
            raise ZipError("has a central directory that overlaps its end record: a damaged zip archive")
        if entries > cd_size // 46:
            raise ZipError(f"claims {entries} members in a {cd_size}-byte central directory: a damaged zip archive")
        directory = self._pread(cd_size, cd_offset)
        pos = 0
        for _ in range(entries):
            if directory[pos : pos + 4] != _CENTRAL or pos + 46 > len(directory):
                raise ZipError(f"has a damaged central directory entry at byte {cd_offset + pos}")
            (flags, method, crc, csize, usize, name_len, extra_len, comment_len, start_disk, offset) = struct.unpack(
                "<8xHH4xIIIHHHH6xI", directory[pos : pos + 46]
            )
            end = pos + 46 + name_len + extra_len + comment_len
            if end > len(directory):
                raise ZipError(f"has a damaged central directory entry at byte {cd_offset + pos}")
            raw_name = directory[pos + 46 : pos + 46 + name_len]
            extra = directory[pos + 46 + name_len : pos + 46 + name_len + extra_len]
            if 0xFFFFFFFF in (csize, usize, offset) or start_disk == 0xFFFF:
                usize, csize, offset = _zip64_extra(extra, usize, csize, offset, start_disk)
            name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", errors="replace")
            if offset + 30 + csize > cd_offset:
                raise ZipError(
                    f"member {name!r} reaches past the start of the central directory: a damaged zip archive"
                )
            if name not in self.members:
                self.order.append(name)
            self.members[name] = ZipMember(name, method, flags, crc, csize, usize, offset)
            pos = end

    def _zip64(self, eocd_offset: int) -> tuple[int, int, int, int, int]:
        if eocd_offset < 20:
            raise ZipError("needs a zip64 end record and has none: a damaged zip archive")
        locator = self._pread(20, eocd_offset - 20)
        if locator[:4] != _EOCD64_LOCATOR:
            raise ZipError("needs a zip64 end record and has none: a damaged zip archive")
        _, record_offset, _ = struct.unpack("<IQI", locator[4:])
        if record_offset + 56 > eocd_offset - 20:
            raise ZipError("has a zip64 end record out of place: a damaged zip archive")
        record = self._pread(56, record_offset)
        if record[:4] != _EOCD64:
            raise ZipError("has a damaged zip64 end record")
        disk, cd_disk, _, entries, cd_size, cd_offset = struct.unpack("<IIQQQQ", record[16:56])
        return entries, cd_size, cd_offset, disk, cd_disk

    # -- members ----------------------------------------------------------------------------------

    def data_offset(self, member: ZipMember) -> int:
        """Where the member's (stored or compressed) bytes start: after its local header."""
        found = self._data_offsets.get(member.name)
        if found is not None:
            return found
        header = self._pread(30, member.header_offset)
        if header[:4] != _LOCAL:
            raise ZipError(
                f"member {member.name!r} has no local header at byte {member.header_offset}: a damaged zip archive"
            )
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        start = member.header_offset + 30 + name_len + extra_len
        if start + member.compressed_size > self.file_size:
            raise ZipError(
                f"member {member.name!r} reaches past the end of the file ({start + member.compressed_size} > {self.file_size})"
            )
        if member.stored and member.compressed_size != member.size:
            raise ZipError(
                f"stored member {member.name!r} has two sizes ({member.compressed_size} and {member.size}): a damaged zip archive"
            )
        self._data_offsets[member.name] = start
        return start

    def read_member(self, member: ZipMember, limit: int) -> bytes:
        """The member's bytes, inflated; at most `limit` bytes, else ZipError before reading."""
        if member.flags & 0x1:
            raise ZipError(f"member {member.name!r} is encrypted")
        if member.size > limit:
            raise ZipError(f"member {member.name!r} is {member.size} bytes, over qtool's limit of {limit}")
        start = self.data_offset(member)
        if member.method == _STORED:
            data = self._pread(member.size, start)
        elif member.method == _DEFLATED:
            data = self._inflate(member, start)
        else:
            raise ZipError(f"member {member.name!r} uses compression method {member.method}, which qtool does not read")
        if zlib.crc32(data) != member.crc:
            raise ZipError(f"Bad CRC-32 for member {member.name!r}: a damaged zip archive")
        return data

    def _inflate(self, member: ZipMember, start: int) -> bytes:
        inflater = zlib.decompressobj(-15)
        out = bytearray()
        want = member.size
        read = 0
        try:
            while read < member.compressed_size and len(out) <= want:
                chunk = self._pread(min(_CHUNK, member.compressed_size - read), start + read)
                read += len(chunk)
                while chunk and len(out) <= want:
                    out += inflater.decompress(chunk, want + 1 - len(out))
                    chunk = inflater.unconsumed_tail
                if inflater.eof:
                    break
        except zlib.error as exc:
            raise ZipError(f"member {member.name!r} does not inflate: {exc}") from None
        if len(out) != want:
            raise ZipError(
                f"member {member.name!r} inflates to a size other than the {want} bytes its directory entry says"
            )
        return bytes(out)


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int, disk: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack("<HH", extra[pos : pos + 4])
        body = extra[pos + 4 : pos + 4 + size]
        if tag == 0x0001:
            values = []
            for i in range(len(body) // 8):
                values.append(struct.unpack("<Q", body[8 * i : 8 * i + 8])[0])
            fields = iter(values)
            try:
                if usize == 0xFFFFFFFF:
                    usize = next(fields)
                if csize == 0xFFFFFFFF:
                    csize = next(fields)
                if offset == 0xFFFFFFFF:
                    offset = next(fields)
            except StopIteration:
                raise ZipError("has a zip64 extra field too short for its sizes: a damaged zip archive") from None
            return usize, csize, offset
        pos += 4 + size
    raise ZipError("has a member with 32-bit sizes at their limit and no zip64 extra field: a damaged zip archive")
