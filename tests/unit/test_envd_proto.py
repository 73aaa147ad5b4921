"""The hand-written protobuf codec of the E2B envd protocol (dsec.compat.proto) against the
reference implementation: Google's ``protobuf`` runtime, given the envd messages as declared
in E2B's ``process.proto`` and ``filesystem.proto`` (package envd/spec of e2b-dev/infra).

The reference messages are described here field by field as descriptors (the runtime builds
message classes from them; no protoc needed). For each sample, dsec's bytes must equal the
runtime's deterministic serialisation, dsec must decode the runtime's bytes to the sample,
and the same both ways for proto3 JSON (``json_format``).
"""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    json_format,
    message_factory,
    timestamp_pb2,
)
from google.protobuf.message import Message

from dsec.compat.proto import ENVD, DecodeError

FD = descriptor_pb2.FieldDescriptorProto
STRING, BYTES, BOOL, UINT32, SINT32, INT64 = (FD.TYPE_STRING, FD.TYPE_BYTES, FD.TYPE_BOOL, FD.TYPE_UINT32,
                                              FD.TYPE_SINT32, FD.TYPE_INT64)
MESSAGE, ENUM = FD.TYPE_MESSAGE, FD.TYPE_ENUM


class Msg:
    """A message declaration: fields, oneofs (proto3 ``optional`` is a oneof of its own,
    named ``_field``), nested messages and map fields."""

    def __init__(self, name: str, *fields: tuple[Any, ...], oneofs: dict[str, list[str]] | None = None,
                 optional: tuple[str, ...] = (), nested: tuple[Msg, ...] = (),
                 maps: tuple[tuple[int, str], ...] = ()) -> None:
        self.proto = descriptor_pb2.DescriptorProto(name=name)
        groups = {**(oneofs or {}), **{f"_{name}": [name] for name in optional}}
        index = {member: i for i, members in enumerate(groups.values()) for member in members}
        for group in groups:
            self.proto.oneof_decl.add(name=group)
        for number, field_name, kind, *type_name in fields:
            f = self.proto.field.add(name=field_name, number=number, type=kind, label=FD.LABEL_OPTIONAL)
            if type_name and type_name[0] == "repeated":
                f.label = FD.LABEL_REPEATED
                type_name = type_name[1:]
            if type_name:
                f.type_name = type_name[0]
            if field_name in index:
                f.oneof_index = index[field_name]
                f.proto3_optional = field_name in optional
        for number, field_name in maps:  # map<string, string>
            entry = "".join(part.capitalize() for part in field_name.split("_")) + "Entry"
            e = self.proto.nested_type.add(name=entry)
            e.options.map_entry = True
            e.field.add(name="key", number=1, type=STRING, label=FD.LABEL_OPTIONAL)
            e.field.add(name="value", number=2, type=STRING, label=FD.LABEL_OPTIONAL)
            self.proto.field.add(name=field_name, number=number, type=MESSAGE, label=FD.LABEL_REPEATED,
                                 type_name=entry)
        for child in nested:
            self.proto.nested_type.add().CopyFrom(child.proto)


def file(package: str, messages: list[Msg], enums: dict[str, dict[str, int]]) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(name=f"{package}.proto", package=package, syntax="proto3")
    proto.dependency.append("google/protobuf/timestamp.proto")
    for m in messages:
        proto.message_type.add().CopyFrom(m.proto)
    for name, values in enums.items():
        enum = proto.enum_type.add(name=name)
        for value_name, number in values.items():
            enum.value.add(name=value_name, number=number)
    return proto


PROCESS = file("process", [
    Msg("PTY", (1, "size", MESSAGE, "Size"), nested=(Msg("Size", (1, "cols", UINT32), (2, "rows", UINT32)),)),
    Msg("ProcessConfig", (1, "cmd", STRING), (2, "args", STRING, "repeated"), (4, "cwd", STRING),
        maps=((3, "envs"),), optional=("cwd",)),
    Msg("ProcessInfo", (1, "config", MESSAGE, "ProcessConfig"), (2, "pid", UINT32), (3, "tag", STRING),
        optional=("tag",)),
    Msg("ListResponse", (1, "processes", MESSAGE, "repeated", "ProcessInfo")),
    Msg("StartRequest", (1, "process", MESSAGE, "ProcessConfig"), (2, "pty", MESSAGE, "PTY"),
        (3, "tag", STRING), (4, "stdin", BOOL), optional=("pty", "tag", "stdin")),
    Msg("ProcessEvent", (1, "start", MESSAGE, "StartEvent"), (2, "data", MESSAGE, "DataEvent"),
        (3, "end", MESSAGE, "EndEvent"), (4, "keepalive", MESSAGE, "KeepAlive"),
        oneofs={"event": ["start", "data", "end", "keepalive"]},
        nested=(Msg("StartEvent", (1, "pid", UINT32)),
                Msg("DataEvent", (1, "stdout", BYTES), (2, "stderr", BYTES), (3, "pty", BYTES),
                    oneofs={"output": ["stdout", "stderr", "pty"]}),
                Msg("EndEvent", (1, "exit_code", SINT32), (2, "exited", BOOL), (3, "status", STRING),
                    (4, "error", STRING), optional=("error",)),
                Msg("KeepAlive"))),
    Msg("StartResponse", (1, "event", MESSAGE, "ProcessEvent")),
    Msg("ProcessSelector", (1, "pid", UINT32), (2, "tag", STRING), oneofs={"selector": ["pid", "tag"]}),
    Msg("SendSignalRequest", (1, "process", MESSAGE, "ProcessSelector"), (2, "signal", ENUM, "Signal")),
    Msg("ProcessInput", (1, "stdin", BYTES), (2, "pty", BYTES), oneofs={"input": ["stdin", "pty"]}),
    Msg("SendInputRequest", (1, "process", MESSAGE, "ProcessSelector"), (2, "input", MESSAGE, "ProcessInput")),
], {"Signal": {"SIGNAL_UNSPECIFIED": 0, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9}})

FILESYSTEM = file("filesystem", [
    Msg("EntryInfo", (1, "name", STRING), (2, "type", ENUM, "FileType"), (3, "path", STRING),
        (4, "size", INT64), (5, "mode", UINT32), (6, "permissions", STRING), (7, "owner", STRING),
        (8, "group", STRING), (9, "modified_time", MESSAGE, ".google.protobuf.Timestamp"),
        (10, "symlink_target", STRING), maps=((11, "metadata"),), optional=("symlink_target",)),
    Msg("StatRequest", (1, "path", STRING)),
    Msg("ListDirRequest", (1, "path", STRING), (2, "depth", UINT32)),
    Msg("ListDirResponse", (1, "entries", MESSAGE, "repeated", "EntryInfo")),
    Msg("WatchDirRequest", (1, "path", STRING), (2, "recursive", BOOL), (3, "include_entry", BOOL)),
], {"FileType": {"FILE_TYPE_UNSPECIFIED": 0, "FILE_TYPE_FILE": 1, "FILE_TYPE_DIRECTORY": 2,
                 "FILE_TYPE_SYMLINK": 3}})


def _pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    timestamp = descriptor_pb2.FileDescriptorProto()
    timestamp_pb2.DESCRIPTOR.CopyToProto(timestamp)
    for proto in (timestamp, PROCESS, FILESYSTEM):
        pool.Add(proto)
    return pool


POOL = _pool()


def reference(name: str, json_value: dict[str, Any]) -> Message:
    """The runtime's message ``name`` (``process.StartRequest``) from its proto3 JSON."""
    cls = message_factory.GetMessageClass(POOL.FindMessageTypeByName(name))
    return json_format.ParseDict(json_value, cls())


# (message, dsec's decoded form, the same message in proto3 JSON as the runtime reads it)
SAMPLES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("process.StartRequest",
     {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo héllo"], "envs": {"A": "1", "B": "two"},
                  "cwd": "/work"},
      "pty": {"size": {"cols": 80, "rows": 24}}, "tag": "t1", "stdin": False},
     {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo héllo"], "envs": {"A": "1", "B": "two"},
                  "cwd": "/work"},
      "pty": {"size": {"cols": 80, "rows": 24}}, "tag": "t1", "stdin": False}),
    # optional fields at their default are still present; an empty cwd too
    ("process.StartRequest", {"process": {"cmd": "true", "cwd": ""}, "tag": "", "stdin": True},
     {"process": {"cmd": "true", "cwd": ""}, "tag": "", "stdin": True}),
    ("process.StartResponse", {"event": {"start": {"pid": 300}}}, {"event": {"start": {"pid": 300}}}),
    ("process.StartResponse", {"event": {"data": {"stdout": b"\x00\xff out"}}},
     {"event": {"data": {"stdout": "AP8gb3V0"}}}),
    ("process.StartResponse", {"event": {"data": {"stderr": b""}}}, {"event": {"data": {"stderr": ""}}}),
    ("process.StartResponse", {"event": {"end": {"exit_code": -1, "exited": True, "status": "exit status 255",
                                                 "error": ""}}},
     {"event": {"end": {"exitCode": -1, "exited": True, "status": "exit status 255", "error": ""}}}),
    ("process.StartResponse", {"event": {"end": {"exit_code": 2147483647, "exited": True}}},
     {"event": {"end": {"exitCode": 2147483647, "exited": True}}}),
    ("process.StartResponse", {"event": {"end": {"exit_code": -2147483648}}},
     {"event": {"end": {"exitCode": -2147483648}}}),
    ("process.StartResponse", {"event": {"keepalive": {}}}, {"event": {"keepalive": {}}}),
    ("process.ListResponse",
     {"processes": [{"config": {"cmd": "sleep", "args": ["9"]}, "pid": 7, "tag": "bg"},
                    {"config": {"cmd": "top"}, "pid": 4294967295}]},
     {"processes": [{"config": {"cmd": "sleep", "args": ["9"]}, "pid": 7, "tag": "bg"},
                    {"config": {"cmd": "top"}, "pid": 4294967295}]}),
    ("process.SendSignalRequest", {"process": {"pid": 0}, "signal": 9},
     {"process": {"pid": 0}, "signal": "SIGNAL_SIGKILL"}),
    ("process.SendSignalRequest", {"process": {"tag": "bg"}, "signal": 15},
     {"process": {"tag": "bg"}, "signal": "SIGNAL_SIGTERM"}),
    ("process.SendInputRequest", {"process": {"pid": 12}, "input": {"stdin": b"line\n"}},
     {"process": {"pid": 12}, "input": {"stdin": "bGluZQo="}}),
    ("filesystem.EntryInfo",
     {"name": "big.bin", "type": 1, "path": "/work/big.bin", "size": 5_000_000_000, "mode": 0o100644,
      "permissions": "-rw-r--r--", "owner": "user", "group": "user", "modified_time": 1700000000.5,
      "symlink_target": "", "metadata": {"k": "v"}},
     {"name": "big.bin", "type": "FILE_TYPE_FILE", "path": "/work/big.bin", "size": "5000000000",
      "mode": 0o100644, "permissions": "-rw-r--r--", "owner": "user", "group": "user",
      "modifiedTime": "2023-11-14T22:13:20.500Z", "symlinkTarget": "", "metadata": {"k": "v"}}),
    ("filesystem.EntryInfo", {"name": "l", "type": 3, "size": -1, "modified_time": 86400.0, "symlink_target": "/x"},
     {"name": "l", "type": "FILE_TYPE_SYMLINK", "size": "-1", "modifiedTime": "1970-01-02T00:00:00Z",
      "symlinkTarget": "/x"}),
    ("filesystem.ListDirRequest", {"path": "/work", "depth": 3}, {"path": "/work", "depth": 3}),
    ("filesystem.ListDirResponse",
     {"entries": [{"name": "a", "type": 2, "path": "/a", "modified_time": 1.25}, {"name": "b", "path": "/b"}]},
     {"entries": [{"name": "a", "type": "FILE_TYPE_DIRECTORY", "path": "/a", "modifiedTime": "1970-01-01T00:00:01.250Z"},
                  {"name": "b", "path": "/b"}]}),
]
IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(SAMPLES)]


@pytest.mark.parametrize(("name", "value", "json_value"), SAMPLES, ids=IDS)
def test_binary_encoding_matches_the_reference(name: str, value: dict[str, Any], json_value: dict[str, Any]) -> None:
    expected = reference(name, json_value).SerializeToString(deterministic=True)
    assert ENVD.encode(name, value) == expected


@pytest.mark.parametrize(("name", "value", "json_value"), SAMPLES, ids=IDS)
def test_binary_decoding_of_reference_bytes(name: str, value: dict[str, Any], json_value: dict[str, Any]) -> None:
    assert ENVD.decode(name, reference(name, json_value).SerializeToString()) == value


@pytest.mark.parametrize(("name", "value", "json_value"), SAMPLES, ids=IDS)
def test_json_matches_the_reference(name: str, value: dict[str, Any], json_value: dict[str, Any]) -> None:
    ref = reference(name, json_value)
    assert ENVD.to_json(name, value) == json_format.MessageToDict(ref)
    assert ENVD.from_json(name, json_format.MessageToDict(ref)) == value
    assert ENVD.from_json(name, json_format.MessageToDict(ref, preserving_proto_field_name=True)) == value


def test_default_scalars_are_left_out_as_proto3_says() -> None:
    value = {"name": "", "type": 0, "size": 0, "mode": 0, "metadata": {}}
    assert ENVD.encode("filesystem.EntryInfo", value) == b""
    assert reference("filesystem.EntryInfo", {}).SerializeToString() == b""
    assert ENVD.to_json("filesystem.EntryInfo", value) == {}


def test_unknown_fields_are_skipped() -> None:
    # A newer message with fields this side does not know: WatchDirRequest shares field 1
    # (path) with StatRequest; its bool fields 2 and 3 are unknown to StatRequest.
    newer = reference("filesystem.WatchDirRequest", {"path": "/w", "recursive": True, "includeEntry": True})
    assert ENVD.decode("filesystem.StatRequest", newer.SerializeToString()) == {"path": "/w"}
    assert ENVD.from_json("filesystem.StatRequest", {"path": "/w", "recursive": True}) == {"path": "/w"}


def test_a_map_entry_with_an_empty_value_decodes() -> None:
    ref = reference("process.ProcessConfig", {"cmd": "env", "envs": {"EMPTY": "", "": "no name"}})
    assert ENVD.decode("process.ProcessConfig", ref.SerializeToString()) == \
        {"cmd": "env", "envs": {"EMPTY": "", "": "no name"}}


def test_bytes_cut_inside_a_field_are_a_decode_error() -> None:
    data = reference("process.StartRequest", SAMPLES[0][2]).SerializeToString()
    # 1: a key without its length; 3: inside the ProcessConfig field; -1: the last field
    # (stdin, key 0x20) without its value.
    assert data[0] == 0x0A and data[-2:] == b"\x20\x00"
    for end in (1, 3, len(data) - 1):
        with pytest.raises(DecodeError):
            ENVD.decode("process.StartRequest", data[:end])


@pytest.mark.parametrize("data", [
    {"process": "not an object"},
    {"process": {"args": "not a list"}},
    {"process": {"envs": ["not", "a", "map"]}},
    {"stdin": "yes"},
    {"tag": 5},
])
def test_json_of_the_wrong_shape_is_a_decode_error(data: dict[str, Any]) -> None:
    with pytest.raises(DecodeError):
        ENVD.from_json("process.StartRequest", data)


def test_json_integers_and_enums_are_checked() -> None:
    with pytest.raises(DecodeError):
        ENVD.from_json("process.SendSignalRequest", {"signal": "SIGNAL_SIGHUP"})
    with pytest.raises(DecodeError):
        ENVD.from_json("filesystem.ListDirRequest", {"depth": 1.5})
    with pytest.raises(DecodeError):
        ENVD.from_json("filesystem.ListDirRequest", {"depth": True})
    assert ENVD.from_json("filesystem.EntryInfo", {"size": "12"}) == {"size": 12}
