"""A small, schema-driven protobuf codec: proto3 JSON and the binary wire format.

envd's services (``process.proto``, ``filesystem.proto``) need only a dozen messages, so
instead of generated code and a protobuf runtime dependency, each message is declared here
once, field by field, and both encodings are derived from that declaration. A decoded
message is a plain ``dict`` keyed by proto field names (snake_case); a field that is absent
from the dict is absent on the wire. Unknown fields are skipped when decoding, as proto3
requires, so a newer client stays compatible.

Presence follows proto3: a scalar at its default value is not encoded unless the field has
explicit presence (``optional``, a oneof member) or is a message.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import struct
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]

_VARINT = {"uint32", "int32", "int64", "uint64", "bool", "enum"}
_INT64 = {"int64", "uint64"}
_INTS = {"uint32", "int32", "sint32", "int64", "uint64"}


class DecodeError(ValueError):
    """A message that cannot be decoded (malformed bytes or JSON of the wrong shape)."""


@dataclass(frozen=True)
class Field:
    number: int
    name: str
    kind: str  # a scalar kind, "enum", "message", "map" (string -> string) or "timestamp"
    type: str = ""  # message or enum name for kind "message" / "enum"
    repeated: bool = False
    presence: bool = False  # proto3 ``optional`` or a oneof member

    @property
    def json_name(self) -> str:
        head, *rest = self.name.split("_")
        return head + "".join(part.capitalize() for part in rest)


@dataclass(frozen=True)
class Schema:
    messages: dict[str, tuple[Field, ...]]
    enums: dict[str, dict[str, int]]

    def fields(self, message: str) -> tuple[Field, ...]:
        return self.messages[message]

    # JSON (https://protobuf.dev/programming-guides/json/)
    def to_json(self, message: str, value: Message) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in self.fields(message):
            if f.name not in value or not _present(f, value[f.name]):
                continue
            v = value[f.name]
            if f.repeated:
                out[f.json_name] = [self._json_value(f, item) for item in v]
            elif f.kind == "map":
                out[f.json_name] = {str(k): str(item) for k, item in v.items()}
            else:
                out[f.json_name] = self._json_value(f, v)
        return out

    def _json_value(self, f: Field, v: Any) -> Any:
        if f.kind == "message":
            return self.to_json(f.type, v)
        if f.kind == "bytes":
            return base64.b64encode(bytes(v)).decode("ascii")
        if f.kind in _INT64:
            return str(int(v))
        if f.kind == "enum":
            names = {number: name for name, number in self.enums[f.type].items()}
            return names.get(int(v), int(v))
        if f.kind == "timestamp":
            return _rfc3339(float(v))
        return v

    def from_json(self, message: str, data: Any) -> Message:
        if not isinstance(data, dict):
            raise DecodeError(f"{message}: expected a JSON object")
        out: Message = {}
        for f in self.fields(message):
            raw = data.get(f.json_name, data.get(f.name))
            if raw is None:
                continue
            try:
                if f.repeated:
                    out[f.name] = [self._from_json_value(f, item) for item in _list(raw)]
                elif f.kind == "map":
                    if not isinstance(raw, dict):
                        raise DecodeError("expected an object")
                    out[f.name] = {str(k): str(item) for k, item in raw.items()}
                else:
                    out[f.name] = self._from_json_value(f, raw)
            except (DecodeError, ValueError, TypeError, binascii.Error) as exc:
                raise DecodeError(f"{message}.{f.name}: {exc}") from None
        return out

    def _from_json_value(self, f: Field, raw: Any) -> Any:
        if f.kind == "message":
            return self.from_json(f.type, raw)
        if f.kind == "string":
            if not isinstance(raw, str):
                raise DecodeError("expected a string")
            return raw
        if f.kind == "bytes":
            text = str(raw).replace("-", "+").replace("_", "/")
            return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
        if f.kind == "bool":
            if not isinstance(raw, bool):
                raise DecodeError("expected a boolean")
            return raw
        if f.kind in _INTS:
            if isinstance(raw, bool) or not isinstance(raw, (int, str, float)):
                raise DecodeError("expected an integer")
            if isinstance(raw, float) and not raw.is_integer():
                raise DecodeError("expected an integer")
            return int(raw)
        if f.kind == "enum":
            values = self.enums[f.type]
            if isinstance(raw, str):
                if raw not in values:
                    raise DecodeError(f"unknown {f.type} value {raw!r}")
                return values[raw]
            return int(raw)
        if f.kind == "timestamp":
            return _parse_rfc3339(str(raw))
        raise DecodeError(f"unsupported kind {f.kind}")

    # binary wire format (https://protobuf.dev/programming-guides/encoding/)
    def encode(self, message: str, value: Message) -> bytes:
        out = bytearray()
        for f in self.fields(message):
            if f.name not in value or not _present(f, value[f.name]):
                continue
            v = value[f.name]
            if f.kind == "map":
                for key, item in v.items():
                    entry = _key(1, 2) + _len(str(key).encode()) + _key(2, 2) + _len(str(item).encode())
                    out += _key(f.number, 2) + _len(entry)
            elif f.repeated:
                for item in v:
                    out += self._encode_value(f, item)
            else:
                out += self._encode_value(f, v)
        return bytes(out)

    def _encode_value(self, f: Field, v: Any) -> bytes:
        if f.kind == "message":
            return _key(f.number, 2) + _len(self.encode(f.type, v))
        if f.kind == "timestamp":
            seconds, nanos = _split_time(float(v))
            body = _key(1, 0) + _varint(seconds) + (_key(2, 0) + _varint(nanos) if nanos else b"")
            return _key(f.number, 2) + _len(body)
        if f.kind == "string":
            return _key(f.number, 2) + _len(v.encode())
        if f.kind == "bytes":
            return _key(f.number, 2) + _len(bytes(v))
        if f.kind == "sint32":
            n = int(v)
            return _key(f.number, 0) + _varint((n << 1) ^ (n >> 31))
        if f.kind in _VARINT:
            return _key(f.number, 0) + _varint(int(v))
        raise ValueError(f"unsupported kind {f.kind}")

    def decode(self, message: str, data: bytes) -> Message:
        by_number = {f.number: f for f in self.fields(message)}
        out: Message = {}
        pos = 0
        try:
            while pos < len(data):
                key, pos = _read_varint(data, pos)
                number, wire = key >> 3, key & 7
                if wire == 0:
                    raw: Any
                    raw, pos = _read_varint(data, pos)
                elif wire == 1:
                    raw, pos = data[pos:pos + 8], pos + 8
                elif wire == 5:
                    raw, pos = data[pos:pos + 4], pos + 4
                elif wire == 2:
                    size, pos = _read_varint(data, pos)
                    raw, pos = data[pos:pos + size], pos + size
                    if len(raw) != size:
                        raise DecodeError("truncated field")
                else:
                    raise DecodeError(f"unsupported wire type {wire}")
                if pos > len(data):
                    raise DecodeError("truncated message")
                f = by_number.get(number)
                if f is None:
                    continue  # an unknown field: skipped
                value = self._decode_value(f, wire, raw)
                if f.kind == "map":
                    out.setdefault(f.name, {}).update(value)
                elif f.repeated:
                    out.setdefault(f.name, []).append(value)
                else:
                    out[f.name] = value
        except (IndexError, UnicodeDecodeError, struct.error) as exc:
            raise DecodeError(f"{message}: malformed: {exc}") from None
        return out

    def _decode_value(self, f: Field, wire: int, raw: Any) -> Any:
        expected = 0 if (f.kind in _VARINT or f.kind == "sint32") else 2
        if wire != expected:
            raise DecodeError(f"field {f.name}: wire type {wire}, expected {expected}")
        if f.kind == "message":
            return self.decode(f.type, raw)
        if f.kind == "map":
            entry = _Entry.decode(raw)
            return {entry.get(1, b"").decode(): entry.get(2, b"").decode()}
        if f.kind == "timestamp":
            entry = _Entry.decode(raw)
            return int(entry.get(1, 0)) + int(entry.get(2, 0)) / 1e9
        if f.kind == "string":
            return bytes(raw).decode()
        if f.kind == "bytes":
            return bytes(raw)
        if f.kind == "bool":
            return bool(raw)
        if f.kind == "sint32":
            return (raw >> 1) ^ -(raw & 1)
        if f.kind in ("int32", "int64"):
            return raw - (1 << 64) if raw >= 1 << 63 else raw
        return raw


class _Entry:
    """Decode a tiny message of numbered varint/bytes fields (map entries, Timestamp)."""

    @staticmethod
    def decode(data: bytes) -> dict[int, Any]:
        out: dict[int, Any] = {}
        pos = 0
        while pos < len(data):
            key, pos = _read_varint(data, pos)
            if key & 7 == 0:
                out[key >> 3], pos = _read_varint(data, pos)
            elif key & 7 == 2:
                size, pos = _read_varint(data, pos)
                out[key >> 3], pos = bytes(data[pos:pos + size]), pos + size
            else:
                raise DecodeError("unexpected wire type in entry")
        return out


def _present(f: Field, v: Any) -> bool:
    if f.repeated or f.kind == "map":
        return bool(v)
    if f.presence or f.kind in ("message", "timestamp"):
        return v is not None
    return v not in (None, "", b"", 0, False)


def _list(raw: Any) -> list[Any]:
    if not isinstance(raw, list):
        raise DecodeError("expected an array")
    return raw


def _key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32/int64 are ten-byte two's complement
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len(data: bytes) -> bytes:
    return _varint(len(data)) + data


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise DecodeError("varint too long")


def _split_time(t: float) -> tuple[int, int]:
    seconds = int(t // 1)
    return seconds, int(round((t - seconds) * 1e9)) % 1_000_000_000


def _rfc3339(t: float) -> str:
    seconds, nanos = _split_time(t)
    stamp = dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    if nanos:
        frac = f"{nanos:09d}"
        frac = frac[:3] if frac.endswith("000000") else frac[:6] if frac.endswith("000") else frac
        stamp += "." + frac
    return stamp + "Z"


def _parse_rfc3339(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def F(number: int, name: str, kind: str, type: str = "", *, repeated: bool = False,
      presence: bool = False) -> Field:
    return Field(number, name, kind, type, repeated, presence)


# The envd messages this server speaks (e2b-dev/infra packages/envd/spec/{process,filesystem}).
# Oneof members are declared with presence=True.
ENVD = Schema(
    messages={
        # process.proto
        "process.PTY": (F(1, "size", "message", "process.PTY.Size"),),
        "process.PTY.Size": (F(1, "cols", "uint32"), F(2, "rows", "uint32")),
        "process.ProcessConfig": (
            F(1, "cmd", "string"), F(2, "args", "string", repeated=True), F(3, "envs", "map"),
            F(4, "cwd", "string", presence=True)),
        "process.ListRequest": (),
        "process.ProcessInfo": (
            F(1, "config", "message", "process.ProcessConfig"), F(2, "pid", "uint32"),
            F(3, "tag", "string", presence=True)),
        "process.ListResponse": (F(1, "processes", "message", "process.ProcessInfo", repeated=True),),
        "process.StartRequest": (
            F(1, "process", "message", "process.ProcessConfig"), F(2, "pty", "message", "process.PTY"),
            F(3, "tag", "string", presence=True), F(4, "stdin", "bool", presence=True)),
        "process.UpdateRequest": (
            F(1, "process", "message", "process.ProcessSelector"), F(2, "pty", "message", "process.PTY")),
        "process.UpdateResponse": (),
        "process.ProcessEvent": (
            F(1, "start", "message", "process.ProcessEvent.StartEvent"),
            F(2, "data", "message", "process.ProcessEvent.DataEvent"),
            F(3, "end", "message", "process.ProcessEvent.EndEvent"),
            F(4, "keepalive", "message", "process.ProcessEvent.KeepAlive")),
        "process.ProcessEvent.StartEvent": (F(1, "pid", "uint32"),),
        "process.ProcessEvent.DataEvent": (
            F(1, "stdout", "bytes", presence=True), F(2, "stderr", "bytes", presence=True),
            F(3, "pty", "bytes", presence=True)),
        "process.ProcessEvent.EndEvent": (
            F(1, "exit_code", "sint32"), F(2, "exited", "bool"), F(3, "status", "string"),
            F(4, "error", "string", presence=True)),
        "process.ProcessEvent.KeepAlive": (),
        "process.StartResponse": (F(1, "event", "message", "process.ProcessEvent"),),
        "process.ConnectResponse": (F(1, "event", "message", "process.ProcessEvent"),),
        "process.SendInputRequest": (
            F(1, "process", "message", "process.ProcessSelector"),
            F(2, "input", "message", "process.ProcessInput")),
        "process.SendInputResponse": (),
        "process.ProcessInput": (F(1, "stdin", "bytes", presence=True), F(2, "pty", "bytes", presence=True)),
        "process.SendSignalRequest": (
            F(1, "process", "message", "process.ProcessSelector"), F(2, "signal", "enum", "process.Signal")),
        "process.SendSignalResponse": (),
        "process.StreamInputRequest": (
            F(1, "start", "message", "process.StreamInputRequest.StartEvent"),
            F(2, "data", "message", "process.StreamInputRequest.DataEvent"),
            F(3, "keepalive", "message", "process.StreamInputRequest.KeepAlive")),
        "process.StreamInputRequest.StartEvent": (F(1, "process", "message", "process.ProcessSelector"),),
        "process.StreamInputRequest.DataEvent": (F(2, "input", "message", "process.ProcessInput"),),
        "process.StreamInputRequest.KeepAlive": (),
        "process.StreamInputResponse": (),
        "process.CloseStdinRequest": (F(1, "process", "message", "process.ProcessSelector"),),
        "process.CloseStdinResponse": (),
        "process.ConnectRequest": (F(1, "process", "message", "process.ProcessSelector"),),
        "process.ProcessSelector": (F(1, "pid", "uint32", presence=True), F(2, "tag", "string", presence=True)),
        # filesystem.proto
        "filesystem.MoveRequest": (F(1, "source", "string"), F(2, "destination", "string")),
        "filesystem.MoveResponse": (F(1, "entry", "message", "filesystem.EntryInfo"),),
        "filesystem.MakeDirRequest": (F(1, "path", "string"),),
        "filesystem.MakeDirResponse": (F(1, "entry", "message", "filesystem.EntryInfo"),),
        "filesystem.RemoveRequest": (F(1, "path", "string"),),
        "filesystem.RemoveResponse": (),
        "filesystem.StatRequest": (F(1, "path", "string"),),
        "filesystem.StatResponse": (F(1, "entry", "message", "filesystem.EntryInfo"),),
        "filesystem.EntryInfo": (
            F(1, "name", "string"), F(2, "type", "enum", "filesystem.FileType"), F(3, "path", "string"),
            F(4, "size", "int64"), F(5, "mode", "uint32"), F(6, "permissions", "string"),
            F(7, "owner", "string"), F(8, "group", "string"), F(9, "modified_time", "timestamp"),
            F(10, "symlink_target", "string", presence=True), F(11, "metadata", "map")),
        "filesystem.ListDirRequest": (F(1, "path", "string"), F(2, "depth", "uint32")),
        "filesystem.ListDirResponse": (F(1, "entries", "message", "filesystem.EntryInfo", repeated=True),),
    },
    enums={
        "process.Signal": {"SIGNAL_UNSPECIFIED": 0, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9},
        "filesystem.FileType": {"FILE_TYPE_UNSPECIFIED": 0, "FILE_TYPE_FILE": 1,
                                "FILE_TYPE_DIRECTORY": 2, "FILE_TYPE_SYMLINK": 3},
    },
)
