"""Frame codec for the agent wire protocol (docs/AGENT_PROTOCOL.md).

``u32 BE body length | body``; ``body = u8 type | field*``;
``field = u8 key length | key | u32 BE value length | value``. Integers are decimal ASCII.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterable
from dataclasses import dataclass

MAX_FRAME = 64 << 20

Value = bytes | str | int
_U32 = struct.Struct(">I")


def encode(kind: str, fields: Iterable[tuple[str, Value]] = ()) -> bytes:
    """One frame of type ``kind``. ``str`` values are UTF-8, ``int`` values decimal ASCII."""
    parts = [kind.encode("ascii")]
    for key, value in fields:
        k = key.encode("ascii")
        if isinstance(value, int):
            v = str(value).encode("ascii")
        elif isinstance(value, str):
            v = value.encode()
        else:
            v = bytes(value)
        parts += (bytes((len(k),)), k, _U32.pack(len(v)), v)
    body = b"".join(parts)
    if len(body) > MAX_FRAME:
        raise ValueError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return _U32.pack(len(body)) + body


@dataclass(frozen=True, slots=True)
class Frame:
    type: str
    fields: tuple[tuple[str, bytes], ...]

    def get(self, key: str) -> bytes | None:
        """The first value of ``key``, None if absent."""
        for k, v in self.fields:
            if k == key:
                return v
        return None

    def data(self, key: str) -> bytes:
        v = self.get(key)
        return b"" if v is None else v

    def text(self, key: str, default: str = "") -> str:
        v = self.get(key)
        return default if v is None else v.decode(errors="replace")

    def num(self, key: str, default: int = 0, base: int = 10) -> int:
        v = self.get(key)
        return default if v is None else int(v, base)

    def all(self, key: str) -> list[bytes]:
        return [v for k, v in self.fields if k == key]


def decode(body: bytes) -> Frame:
    """Parse a frame body (without its length prefix)."""
    if not body:
        raise ValueError("empty frame")
    view, pos, fields = memoryview(body), 1, []
    while pos < len(body):
        klen = body[pos]
        vstart = pos + 1 + klen + 4
        if vstart > len(body):
            raise ValueError("truncated field header")
        (vlen,) = _U32.unpack_from(body, vstart - 4)
        if vstart + vlen > len(body):
            raise ValueError("truncated field value")
        fields.append((body[pos + 1 : pos + 1 + klen].decode("ascii"), bytes(view[vstart : vstart + vlen])))
        pos = vstart + vlen
    return Frame(chr(body[0]), tuple(fields))


async def read_frame(reader: asyncio.StreamReader) -> Frame:
    """Read one frame; raises ``asyncio.IncompleteReadError`` at EOF."""
    (n,) = _U32.unpack(await reader.readexactly(4))
    if not 0 < n <= MAX_FRAME:
        raise ValueError(f"bad frame length {n}")
    return decode(await reader.readexactly(n))
