"""The header of a GGUF file: its version, its tensor count and the scalar and
string values of its metadata (the chat template among them), read without
loading the model. Arrays (the vocabulary, the merges) are skipped.

The layout (little-endian) is llama.cpp's `docs/gguf.md`: the magic `GGUF`,
a uint32 version (2 or 3: lengths and counts are uint64), a uint64 tensor
count, a uint64 key-value count, then each key as a string and its value as a
uint32 type followed by the value.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from overbrainer_prefect.delivery import DeliveryError

GGUF_MAGIC = b"GGUF"
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

MAX_KEYS = 1 << 20  # key-value pairs a header may declare: real ones hold a few dozen
MAX_STRING = 64 << 20  # bytes of one string: a chat template is a few KiB, a token a few bytes
MAX_ARRAY_DEPTH = 4  # arrays of arrays a header may nest: real ones do not nest at all

_STRING = 8
_ARRAY = 9
_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}

Value = str | int | float | bool


class GgufError(DeliveryError):
    """A file is not a readable GGUF."""


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF's header says: its version, how many tensors it holds, and
    its scalar and string metadata values by key."""

    version: int
    tensor_count: int
    metadata: dict[str, Value] = field(default_factory=dict)

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template the converter copied from the tokenizer, if any."""
        value = self.metadata.get(CHAT_TEMPLATE_KEY)
        return value if isinstance(value, str) else None


def read_header(path: Path) -> GgufHeader:
    """Reads the header of the GGUF file `path`.

    Raises GgufError naming the file when it does not start with the GGUF magic,
    has a version other than 2 or 3, or is cut short or malformed; OSError when
    it cannot be read.
    """
    size = path.stat().st_size
    with open(path, "rb") as file:
        return _Reader(file, path, size).header()


class _Reader:
    def __init__(self, file: BinaryIO, path: Path, size: int) -> None:
        self.file = file
        self.path = path
        self.size = size

    def header(self) -> GgufHeader:
        if self.file.read(4) != GGUF_MAGIC:
            raise GgufError(f"{self.path.name} is not a GGUF file (it does not start with GGUF)")
        version = self._unpack("<I")
        if version not in (2, 3):
            raise GgufError(f"{self.path.name} is GGUF version {version}: only 2 and 3 are read")
        tensors = self._unpack("<Q")
        count = self._unpack("<Q")
        if count > MAX_KEYS:
            raise self._malformed()
        metadata: dict[str, Value] = {}
        for _ in range(count):
            key = self._string()
            kind = self._unpack("<I")
            value = self._value(kind, 0)
            if value is not None:
                metadata[key] = value
        return GgufHeader(version=int(version), tensor_count=int(tensors), metadata=metadata)

    def _value(self, kind: int, depth: int) -> Value | None:
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            value: Value = struct.unpack(fmt, self._read(struct.calcsize(fmt)))[0]
            return value
        if kind == _ARRAY and depth < MAX_ARRAY_DEPTH:
            self._skip_array(depth + 1)
            return None
        raise self._malformed()

    def _skip_array(self, depth: int) -> None:
        kind = self._unpack("<I")
        count = int(self._unpack("<Q"))
        if kind in _SCALARS:
            self._skip(count * struct.calcsize(_SCALARS[kind]))
            return
        if kind not in (_STRING, _ARRAY) or count > self.size:
            raise self._malformed()
        for _ in range(count):
            if kind == _STRING:
                self._skip(self._length())
            else:
                self._value(_ARRAY, depth)

    def _string(self) -> str:
        data = self._read(self._length())
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise self._malformed() from None

    def _length(self) -> int:
        length = int(self._unpack("<Q"))
        if length > MAX_STRING:
            raise self._malformed()
        return length

    def _unpack(self, fmt: str) -> int:
        (value,) = struct.unpack(fmt, self._read(struct.calcsize(fmt)))
        return int(value)

    def _read(self, count: int) -> bytes:
        data = self.file.read(count)
        if len(data) != count:
            raise GgufError(f"{self.path.name} is cut short: its GGUF header ends early")
        return data

    def _skip(self, count: int) -> None:
        position = self.file.tell() + count
        if position > self.size:
            raise GgufError(f"{self.path.name} is cut short: its GGUF header ends early")
        self.file.seek(position)

    def _malformed(self) -> GgufError:
        return GgufError(
            f"{self.path.name} has a malformed GGUF header (at byte {self.file.tell()})"
        )
