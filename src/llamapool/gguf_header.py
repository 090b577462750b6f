"""A GGUF file's header, read with ``struct`` from a memory map: its key/value fields and tensor infos.

gguf's own ``GGUFReader`` builds a numpy view of every value, the tokenizer's strings included: over
a minute for Gemma 3's 262,144-token vocabulary on a busy two-core machine, 18 s for ``llamapool
models``. This reads the same header (GGUF v2 and v3: the magic, the version, the tensor and key/value
counts, then each key with its type and value) in a few tens of milliseconds: a long array (the
tokenizer's) is skipped, not decoded (:class:`Skipped` keeps its length): by one seek when its elements
have a fixed size, by reading each string's length alone when they are strings.

- :func:`read_fields`: the key/value fields, as far as the caller needs them (``until``);
- :func:`read_header`: the fields and the tensor infos (the memory estimate's weights).

Both raise ``ValueError`` naming the file for one that is not a GGUF, too old, or truncated.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
SMALL = 4096  # arrays longer than this (the tokenizer's) are skipped, their length kept
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Skipped:
    """A long array of the header, not read: its length."""

    length: int


@dataclass(frozen=True, slots=True)
class Header:
    fields: dict[str, Any]
    tensors: list[tuple[str, int, int]]  # name, elements, ggml type
    data_offset: int  # where the tensor data starts


class _Cursor:
    """A position in the mapped file and the reads that advance it (``struct.error`` past its end)."""

    def __init__(self, mm: mmap.mmap, path: str) -> None:
        self.mm, self.path, self.pos = mm, path, 0

    def take(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.mm, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def u32(self) -> int:
        (v,) = _U32.unpack_from(self.mm, self.pos)
        self.pos += 4
        return int(v)

    def count(self) -> int:
        (n,) = _U64.unpack_from(self.mm, self.pos)
        self.pos += 8
        if n > len(self.mm) - self.pos:
            raise struct.error  # more than the file holds: a corrupt or truncated header
        return int(n)

    def text(self) -> str:
        n = self.count()
        self.pos += n
        return bytes(self.mm[self.pos - n:self.pos]).decode("utf-8", "replace")

    def value(self, vtype: int) -> Any:
        """The value of type ``vtype`` here: a long array is skipped (:class:`Skipped`)."""
        if vtype == _STRING:
            return self.text()
        if vtype == _ARRAY:
            etype, n = self.u32(), self.count()
            if n > SMALL:
                self._skip_array(etype, n)
                return Skipped(n)
            return [self.value(etype) for _ in range(n)]
        if vtype not in _SCALAR:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")
        return self.take(_SCALAR[vtype])

    def _skip_array(self, etype: int, n: int) -> None:
        if etype == _STRING:  # each string's length alone: the loop is the one cost of a 262k vocabulary
            mm, pos, length = self.mm, self.pos, _U64.unpack_from
            for _ in range(n):
                pos += 8 + length(mm, pos)[0]
            if pos > len(mm):
                raise struct.error
            self.pos = pos
        elif etype in _SCALAR:
            self.pos += n * struct.calcsize(_SCALAR[etype])
        else:
            raise ValueError(f"{self.path}: an array of arrays is too long to skip")

    def preamble(self) -> tuple[int, int]:
        """The magic and the version checked: (tensors, key/value fields)."""
        if bytes(self.mm[:4]) != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (no GGUF magic)")
        self.pos = 4
        version = self.u32()
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is too old")
        n_tensors = self.take("<Q")
        return n_tensors, self.take("<Q")

    def fields(self, n_kv: int, until: Callable[[dict[str, Any]], bool] | None) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self.text()
            fields[key] = self.value(self.u32())
            if until is not None and until(fields):
                break
        return fields

    def tensors(self, n_tensors: int) -> list[tuple[str, int, int]]:
        tensors = []
        for _ in range(n_tensors):
            name = self.text()
            elements = 1
            for _ in range(self.u32()):
                elements *= self.take("<Q")
            tensors.append((name, elements, self.u32()))
            self.take("<Q")  # its offset in the data
        return tensors


def _open(path: str, read: Callable[[_Cursor], T]) -> T:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError(f"{path}: not a GGUF file (empty)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                return read(_Cursor(mm, path))
            except struct.error:
                raise ValueError(f"{path}: a truncated GGUF header") from None


def read_fields(path: str | os.PathLike[str],
                until: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
    """The header's key/value fields in the file's order (long arrays :class:`Skipped`); with ``until``,
    no more once ``until(fields)`` holds (``llamapool models`` stops once it has its columns)."""

    def read(c: _Cursor) -> dict[str, Any]:
        _, n_kv = c.preamble()
        return c.fields(n_kv, until)

    return _open(str(path), read)


def read_header(path: str | os.PathLike[str]) -> Header:
    """Every key/value field (long arrays :class:`Skipped`) and every tensor's name, size and type."""

    def read(c: _Cursor) -> Header:
        n_tensors, n_kv = c.preamble()
        fields = c.fields(n_kv, None)
        tensors = c.tensors(n_tensors)
        align = int(fields.get("general.alignment", 32))
        return Header(fields, tensors, -(-c.pos // align) * align)

    return _open(str(path), read)
