"""A pickle interpreter that runs no code: every opcode of protocols 0-5, with the caller
deciding what each global, persistent id, call and BUILD means.

Python's own unpickler imports whatever a pickle names and calls it. This one never imports
or calls anything: `GLOBAL` asks the caller's `Hooks.find_class`, which returns a value of its
own (or raises to refuse the name); `REDUCE`, `NEWOBJ`, `INST` and `OBJ` hand that value and the
arguments to `Hooks.call`; `BUILD` to `Hooks.build`; persistent ids to `Hooks.persistent_load`.

Bounded, whatever the bytes:

- Time is linear in the pickle's size: each opcode does work proportional to what it reads
  or pops, and memo references are references, never copies (a "billion laughs" pickle is as
  small in memory as on disk).
- Memory: at most `max_objects` containers, strings, dict entries, marks and results are
  created (4M by default: a few hundred MB at worst; a torch state dict needs about 16 per
  tensor), and an integer takes at most `MAX_INT_BYTES` bytes. The caller caps the pickle's
  size, which bounds the rest (stack slots of shared objects, 8 bytes each).
- References (`max_references`, when the caller asks): a memo reference costs the pickle 2-5
  bytes but may cost its reader a record per reference (a state dict naming one memoized
  tensor 1.2M times). The caller may allow `max_references` of them plus `REFERENCES_PER_CALL`
  per call (a torch tensor needs about 5), so such a pickle stops early, not after minutes.
- Dicts and sets are `PDict` / `PSet`: lists of entries, never hashed, so crafted keys with one
  hash can't make insertion quadratic. A key set twice keeps both entries; readers take the last.

Every str it makes is Unicode text: a lone UTF-16 surrogate (which only the protocol-0 UNICODE
opcode can spell) is refused, as the safetensors and JSON readers refuse one, so no name from a
pickle breaks a UTF-8 output (`--json`, a report) half-way.

Every malformed input raises `PickleError`, with the byte offset; `Truncated` (a subclass)
when the bytes end before `STOP`, so a caller reading a stream can fetch more and retry.
"""

from __future__ import annotations

import codecs
import re
import struct
from typing import Any, Protocol

from qtool.gcpause import paused_gc

__all__ = [
    "PickleError",
    "Truncated",
    "OverLimit",
    "PDict",
    "PSet",
    "Hooks",
    "interpret",
    "MAX_INT_BYTES",
    "REFERENCES_PER_CALL",
]

MAX_INT_BYTES = 256  # LONG1/LONG4 payloads; a tensor checkpoint needs 8
# The one opcode that can make a str no UTF-8 output can carry: raw-unicode-escape spells any
# code point, lone surrogates too (the other string opcodes decode strict UTF-8 or latin-1).
_SURROGATE = re.compile(r"[\ud800-\udfff]")
REFERENCES_PER_CALL = 16  # memo references each REDUCE allows, under `max_references`
_MAX_LINE = 1 << 16  # text opcodes (GLOBAL names, protocol 0 numbers and strings)
_MAX_MEMO_INDEX = 1 << 32
_TOO_MANY_REFERENCES = (
    "the pickle refers back to earlier objects more often than qtool reads (one object under many names)"
)


class PickleError(ValueError):
    def __init__(self, message: str, offset: int | None = None) -> None:
        self.offset = offset
        super().__init__(message if offset is None else f"{message} (at byte {offset} of the pickle)")


class Truncated(PickleError):
    pass


class OverLimit(PickleError):
    """A well-formed pickle that asks more of its reader than the caller allows."""


class PDict:
    """A pickled dict (or OrderedDict): its entries in order, unhashed."""

    __slots__ = ("items", "state")

    def __init__(self) -> None:
        self.items: list[tuple[Any, Any]] = []
        self.state: Any = None  # what BUILD set (an OrderedDict's `_metadata`)


class PSet:
    __slots__ = ("items", "frozen")

    def __init__(self, frozen: bool = False) -> None:
        self.items: list[Any] = []
        self.frozen = frozen


class Hooks(Protocol):
    def find_class(self, module: str, name: str) -> Any: ...
    def persistent_load(self, pid: Any) -> Any: ...
    def call(self, func: Any, args: tuple) -> Any: ...
    def build(self, obj: Any, state: Any) -> Any: ...


class _Mark:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MARK"


_MARK = _Mark()
_SIZED = frozenset(b"qhXKMJrj")  # opcodes whose argument bytes the hot loop reads directly


def _past_end(data: bytes, at: int) -> bool:
    """Whether the opcode at `at` reaches past the end of `data` (then the pickle is cut short)."""
    op = data[at]
    width = {0x71: 1, 0x68: 1, 0x4B: 1, 0x4D: 2, 0x4A: 4, 0x72: 4, 0x6A: 4, 0x58: 4}[op]
    if at + 1 + width > len(data):
        return True
    if op == 0x58:
        return at + 5 + struct.unpack_from("<I", data, at + 1)[0] > len(data)
    return False


_UNPACK_I = struct.Struct("<i").unpack_from
_UNPACK_H = struct.Struct("<H").unpack_from
_UNPACK_UI = struct.Struct("<I").unpack_from
_UNPACK_Q = struct.Struct("<Q").unpack_from
_UNPACK_D = struct.Struct(">d").unpack_from


def interpret(
    data: bytes, hooks: Hooks, *, start: int = 0, max_objects: int = 4_000_000, max_references: int | None = None
) -> tuple[Any, int]:
    """The object the pickle at `data[start:]` describes, and the offset just past its STOP.

    The cyclic garbage collector is paused meanwhile: millions of new containers would make it
    walk all of them again and again (as pickle's own C unpickler avoids by not tracking)."""
    with paused_gc():
        return _Machine(data, hooks, start, max_objects, max_references).run()


class _Machine:
    def __init__(
        self, data: bytes, hooks: Hooks, start: int, max_objects: int, max_references: int | None = None
    ) -> None:
        self.data = data
        self.hooks = hooks
        self.pos = start
        self.budget = max_objects
        self.references = (
            len(data) if max_references is None else max_references
        )  # a get reads >= 2 bytes: never reached
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}

    # -- reading --
    def _take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise Truncated("the pickle ends before its STOP opcode", len(self.data))
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def _line(self) -> bytes:
        end = self.data.find(b"\n", self.pos, self.pos + _MAX_LINE)
        if end < 0:
            if len(self.data) - self.pos < _MAX_LINE:
                raise Truncated("the pickle ends inside a text opcode", len(self.data))
            raise PickleError("a text opcode's line is too long", self.pos)
        line = self.data[self.pos : end]
        self.pos = end + 1
        return line

    def _spend(self, n: int = 1) -> None:
        self.budget -= n
        if self.budget < 0:
            raise PickleError("the pickle builds more objects than qtool's limit", self.pos)

    def _pop_mark(self) -> list[Any]:
        if not self.marks:
            raise PickleError("an opcode needs a MARK and there is none", self.pos)
        items = self.stack
        self.stack = self.marks.pop()
        return items

    def _pop(self) -> Any:
        if not self.stack:
            raise PickleError("stack underflow", self.pos)
        return self.stack.pop()

    def _top(self) -> Any:
        if not self.stack:
            raise PickleError("stack underflow", self.pos)
        return self.stack[-1]

    def _memo_get(self, index: int) -> Any:
        self.references -= 1
        if self.references < 0:
            raise OverLimit(_TOO_MANY_REFERENCES, self.pos)
        try:
            return self.memo[index]
        except KeyError:
            raise PickleError(f"memo entry {index} is read before it is written", self.pos) from None

    def _memo_put(self, index: int) -> None:
        if not 0 <= index < _MAX_MEMO_INDEX:
            raise PickleError(f"memo index {index} is out of range", self.pos)
        if index not in self.memo:
            self._spend()
        self.memo[index] = self._top()

    def _text_int(self, line: bytes) -> int:
        text = line.strip()
        if len(text) > 40 or not text:
            raise PickleError("a text integer is too long or empty", self.pos)
        try:
            return int(text.rstrip(b"L"), 10)
        except ValueError:
            raise PickleError(f"bad text integer {text[:40]!r}", self.pos) from None

    def _long(self, raw: bytes) -> int:
        if len(raw) > MAX_INT_BYTES:
            raise PickleError(f"an integer of {len(raw)} bytes is over qtool's limit of {MAX_INT_BYTES}", self.pos)
        return int.from_bytes(raw, "little", signed=True)

    def _decode(self, raw: bytes, encoding: str = "utf-8") -> str:
        try:
            return raw.decode(encoding)
        except UnicodeDecodeError:
            raise PickleError(f"a string is not valid {encoding}", self.pos) from None

    def _sized(self, n: int) -> bytes:
        if n < 0:
            raise PickleError("a negative length", self.pos)
        if n > len(self.data) - self.pos:
            raise Truncated("a string reaches past the end of the pickle", len(self.data))
        self._spend()
        return self._take(n)

    def _dict_of(self, obj: Any) -> PDict:
        if not isinstance(obj, PDict):
            raise PickleError(f"SETITEM on a {type(obj).__name__}, not a dict", self.pos)
        return obj

    def _list_of(self, obj: Any) -> list:
        if not isinstance(obj, list):
            raise PickleError(f"APPEND on a {type(obj).__name__}, not a list", self.pos)
        return obj

    def _global(self, module: str, name: str) -> Any:
        self._spend()
        return self.hooks.find_class(module, name)

    def _call(self, func: Any, args: Any) -> Any:
        if not isinstance(args, tuple):
            raise PickleError(f"a call's arguments are a {type(args).__name__}, not a tuple", self.pos)
        self._spend()
        return self.hooks.call(func, args)

    # -- the loop --
    def run(self) -> tuple[Any, int]:
        """The hot opcodes inline, on local variables; the rest through `_cold`."""
        data = self.data
        size = len(data)
        pos = self.pos
        stack = self.stack
        memo = self.memo
        references = self.references
        unpack_ui, unpack_h, unpack_i = _UNPACK_UI, _UNPACK_H, _UNPACK_I
        try:
            while True:
                at = pos
                op = data[pos]
                pos += 1
                if op == 0x71:  # BINPUT
                    index = data[pos]
                    pos += 1
                    if index not in memo:
                        self.budget -= 1
                    memo[index] = stack[-1]
                elif op == 0x68:  # BINGET
                    stack.append(memo[data[pos]])
                    pos += 1
                    references -= 1
                    if references < 0:
                        raise OverLimit(_TOO_MANY_REFERENCES, at)
                elif op == 0x28:  # MARK
                    self.marks.append(stack)
                    stack = []
                    self.budget -= 1
                elif op == 0x58:  # BINUNICODE
                    (n,) = unpack_ui(data, pos)
                    end = pos + 4 + n
                    if end > size:
                        raise IndexError
                    stack.append(data[pos + 4 : end].decode("utf-8"))
                    pos = end
                    self.budget -= 1
                elif op == 0x4B:  # BININT1
                    stack.append(data[pos])
                    pos += 1
                elif op == 0x74:  # TUPLE
                    items = stack
                    stack = self.marks.pop()
                    stack.append(tuple(items))
                    self.budget -= 1
                elif op == 0x52:  # REDUCE
                    args = stack.pop()
                    func = stack.pop()
                    self.pos = pos
                    stack.append(self._call(func, args))
                    references += REFERENCES_PER_CALL
                elif op == 0x51:  # BINPERSID
                    pid = stack.pop()
                    self.budget -= 1
                    stack.append(self.hooks.persistent_load(pid))
                elif op == 0x85:  # TUPLE1
                    stack[-1] = (stack[-1],)
                    self.budget -= 1
                elif op == 0x86:  # TUPLE2
                    b = stack.pop()
                    stack[-1] = (stack[-1], b)
                    self.budget -= 1
                elif op == 0x87:  # TUPLE3
                    c = stack.pop()
                    b = stack.pop()
                    stack[-1] = (stack[-1], b, c)
                    self.budget -= 1
                elif op == 0x29:  # EMPTY_TUPLE
                    stack.append(())
                elif op == 0x89:  # NEWFALSE
                    stack.append(False)
                elif op == 0x88:  # NEWTRUE
                    stack.append(True)
                elif op == 0x4E:  # NONE
                    stack.append(None)
                elif op == 0x7D:  # EMPTY_DICT
                    stack.append(PDict())
                    self.budget -= 1
                elif op == 0x5D:  # EMPTY_LIST
                    stack.append([])
                    self.budget -= 1
                elif op == 0x73:  # SETITEM
                    value = stack.pop()
                    key = stack.pop()
                    target = stack[-1]
                    if type(target) is not PDict:
                        raise PickleError(f"SETITEM on a {type(target).__name__}, not a dict", at)
                    target.items.append((key, value))
                    self.budget -= 1
                elif op == 0x61:  # APPEND
                    value = stack.pop()
                    target = stack[-1]
                    if type(target) is not list:
                        raise PickleError(f"APPEND on a {type(target).__name__}, not a list", at)
                    target.append(value)
                elif op == 0x4D:  # BININT2
                    stack.append(unpack_h(data, pos)[0])
                    pos += 2
                elif op == 0x4A:  # BININT
                    stack.append(unpack_i(data, pos)[0])
                    pos += 4
                elif op == 0x72:  # LONG_BINPUT
                    (index,) = unpack_ui(data, pos)
                    pos += 4
                    if index not in memo:
                        self.budget -= 1
                    memo[index] = stack[-1]
                elif op == 0x6A:  # LONG_BINGET
                    stack.append(memo[unpack_ui(data, pos)[0]])
                    pos += 4
                    references -= 1
                    if references < 0:
                        raise OverLimit(_TOO_MANY_REFERENCES, at)
                else:
                    self.pos, self.stack, self.references = pos, stack, references
                    done = self._cold(op, at)
                    if done is not None:
                        return done[0], self.pos
                    pos, stack, references = self.pos, self.stack, self.references
                if self.budget < 0:
                    raise PickleError("the pickle builds more objects than qtool's limit", at)
        except (IndexError, struct.error):
            # a read past the end, or a pop of an empty stack or mark list
            if pos > size or at >= size or (op in _SIZED and _past_end(data, at)):
                raise Truncated("the pickle ends before its STOP opcode", size) from None
            raise PickleError("stack underflow, or an opcode's argument is missing", at) from None
        except KeyError as exc:
            raise PickleError(f"memo entry {exc.args[0]} is read before it is written", at) from None
        except UnicodeDecodeError:
            raise PickleError("a string is not valid utf-8", at) from None

    def _cold(self, op: int, at: int) -> Any:
        """The opcodes `run` doesn't inline. Returns the result wrapped in a tuple at STOP,
        else None."""
        push = self.stack.append
        if op == 0x63:  # GLOBAL
            module = self._decode(self._line(), "utf-8")
            name = self._decode(self._line(), "utf-8")
            push(self._global(module, name))
        elif op == 0x93:  # STACK_GLOBAL
            name = self._pop()
            module = self._pop()
            if not isinstance(module, str) or not isinstance(name, str):
                raise PickleError("STACK_GLOBAL needs two strings", at)
            push(self._global(module, name))
        elif op == 0x75:  # SETITEMS
            items = self._pop_mark()
            target = self._dict_of(self._top())
            if len(items) % 2:
                raise PickleError("SETITEMS with an odd number of items", at)
            self._spend(len(items) // 2)
            target.items.extend(zip(items[::2], items[1::2]))
        elif op == 0x65:  # APPENDS
            items = self._pop_mark()
            self._list_of(self._top()).extend(items)
        elif op == 0x62:  # BUILD
            state = self._pop()
            obj = self._pop()
            push(self.hooks.build(obj, state))
        elif op == 0x8A:  # LONG1
            push(self._long(self._take(self._take(1)[0])))
        elif op == 0x8B:  # LONG4
            n = _UNPACK_I(self._take(4))[0]
            if n < 0:
                raise PickleError("LONG4 with a negative length", at)
            if n > MAX_INT_BYTES:
                raise PickleError(f"an integer of {n} bytes is over qtool's limit of {MAX_INT_BYTES}", at)
            push(self._long(self._take(n)))
        elif op == 0x47:  # BINFLOAT
            push(_UNPACK_D(self._take(8))[0])
        elif op == 0x8C:  # SHORT_BINUNICODE
            push(self._decode(self._sized(self._take(1)[0])))
        elif op == 0x8D:  # BINUNICODE8
            push(self._decode(self._sized(_UNPACK_Q(self._take(8))[0])))
        elif op == 0x42:  # BINBYTES
            push(self._sized(_UNPACK_UI(self._take(4))[0]))
        elif op == 0x43:  # SHORT_BINBYTES
            push(self._sized(self._take(1)[0]))
        elif op in (0x8E, 0x96):  # BINBYTES8, BYTEARRAY8
            push(self._sized(_UNPACK_Q(self._take(8))[0]))
        elif op == 0x55:  # SHORT_BINSTRING (protocol 1 str: bytes decoded as latin-1, as Python 3 does by default)
            push(self._decode(self._sized(self._take(1)[0]), "latin-1"))
        elif op == 0x54:  # BINSTRING
            n = _UNPACK_I(self._take(4))[0]
            push(self._decode(self._sized(n), "latin-1"))
        elif op == 0x94:  # MEMOIZE
            self._memo_put(len(self.memo))
        elif op == 0x95:  # FRAME: a length hint; the bytes follow inline
            self._take(8)
        elif op == 0x80:  # PROTO
            if self._take(1)[0] > 5:
                raise PickleError("unsupported pickle protocol", at)
        elif op == 0x2E:  # STOP
            if len(self.stack) != 1 or self.marks:
                raise PickleError("STOP with a stack that does not hold exactly one object", at)
            return (self.stack[0],)
        elif op == 0x30:  # POP
            if self.stack:
                self.stack.pop()
            else:
                self._pop_mark()
        elif op == 0x31:  # POP_MARK
            self._pop_mark()
        elif op == 0x32:  # DUP
            push(self._top())
        elif op == 0x81:  # NEWOBJ
            args = self._pop()
            cls = self._pop()
            push(self._call(cls, args))
        elif op == 0x92:  # NEWOBJ_EX
            kwargs = self._pop()
            args = self._pop()
            cls = self._pop()
            if not isinstance(kwargs, PDict) or kwargs.items:
                raise PickleError("NEWOBJ_EX with keyword arguments", at)
            push(self._call(cls, args))
        elif op == 0x8F:  # EMPTY_SET
            self._spend()
            push(PSet())
        elif op == 0x90:  # ADDITEMS
            items = self._pop_mark()
            target = self._top()
            if not isinstance(target, PSet) or target.frozen:
                raise PickleError("ADDITEMS on something that is not a set", at)
            target.items.extend(items)
        elif op == 0x91:  # FROZENSET
            self._spend()
            frozen = PSet(frozen=True)
            frozen.items = self._pop_mark()
            self.stack.append(frozen)
        elif op == 0x6C:  # LIST
            self._spend()
            items = self._pop_mark()
            self.stack.append(items)
        elif op == 0x64:  # DICT
            self._spend()
            items = self._pop_mark()
            if len(items) % 2:
                raise PickleError("DICT with an odd number of items", at)
            self._spend(len(items) // 2)
            made = PDict()
            made.items = list(zip(items[::2], items[1::2]))
            self.stack.append(made)
        elif op == 0x49:  # INT (protocol 0; "00"/"01" are False/True)
            line = self._line()
            push({b"00": False, b"01": True}.get(line) if line in (b"00", b"01") else self._text_int(line))
        elif op == 0x4C:  # LONG (protocol 0)
            push(self._text_int(self._line()))
        elif op == 0x46:  # FLOAT (protocol 0)
            text = self._line()
            try:
                push(float(text[:64]) if len(text) <= 64 else float("x"))
            except ValueError:
                raise PickleError(f"bad text float {text[:40]!r}", at) from None
        elif op == 0x53:  # STRING (protocol 0): a quoted, escaped byte string, read as latin-1
            text = self._line()
            if len(text) < 2 or text[:1] != text[-1:] or text[:1] not in (b"'", b'"'):
                raise PickleError("STRING opcode without quotes", at)
            self._spend()
            try:
                push(codecs.escape_decode(text[1:-1])[0].decode("latin-1"))
            except (ValueError, UnicodeDecodeError):
                raise PickleError("STRING opcode with a bad escape", at) from None
        elif op == 0x56:  # UNICODE (protocol 0)
            text = self._line()
            self._spend()
            try:
                value = text.decode("raw-unicode-escape")
            except UnicodeDecodeError:
                raise PickleError("UNICODE opcode with a bad escape", at) from None
            if not value.isascii() and _SURROGATE.search(value):  # `\ud800`: no UTF-8 output can carry it
                raise PickleError("UNICODE opcode holds a lone UTF-16 surrogate, which is not Unicode text", at)
            push(value)
        elif op == 0x67:  # GET
            push(self._memo_get(self._text_int(self._line())))
        elif op == 0x70:  # PUT
            self._memo_put(self._text_int(self._line()))
        elif op == 0x69:  # INST
            module = self._decode(self._line(), "utf-8")
            name = self._decode(self._line(), "utf-8")
            cls = self._global(module, name)
            args = tuple(self._pop_mark())
            self.stack.append(self._call(cls, args))
        elif op == 0x6F:  # OBJ
            items = self._pop_mark()
            if not items:
                raise PickleError("OBJ without a class", at)
            self.stack.append(self._call(items[0], tuple(items[1:])))
        elif op == 0x50:  # PERSID (protocol 0): a text persistent id
            pid = self._decode(self._line(), "ascii")
            self._spend()
            push(self.hooks.persistent_load(pid))
        elif op in (0x82, 0x83, 0x84):
            raise PickleError("the pickle uses the extension registry (EXT1/2/4), which names code", at)
        elif op in (0x97, 0x98):
            raise PickleError("the pickle uses out-of-band buffers (protocol 5), which a file can't carry", at)
        else:
            raise PickleError(f"unknown opcode 0x{op:02x}", at)
