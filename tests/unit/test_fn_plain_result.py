"""The SDK's default decoder of fn call results (``dsec.client.plain``): it admits pickles of
builtin plain values and refuses, without importing or calling anything, every pickle that
names a global, calls, builds, or would make decoding take unbounded memory. No server."""

from __future__ import annotations

import copyreg
import os
import pickle
import struct
from pathlib import Path

import cloudpickle
import pytest

from dsec.client import plain
from dsec.protocol.errors import ResultRefused

PLAIN = [
    None, True, False, 0, -1, 2**100, -(2**70), 1.5, float("inf"), "", "héllo\udc80"[:5],
    b"", b"\x00\xff" * 1000, bytearray(b"ba"), [], (), {}, set(), frozenset(),
    [1, [2, [3, (4, 5)]]], {"a": [1, 2], 3: {"b": None}, (1, 2): frozenset({1})},
    {1, "x", (2, 3)}, ("shared",) * 3, [b"x" * (3 << 20)], list(range(10000)),
]


@pytest.mark.parametrize("protocol", [4, 5])
def test_plain_values_decode_as_pickled(protocol: int) -> None:
    """Workers pickle at protocol 5 (cloudpickle's default), where every plain value has an
    opcode of its own (4 lacks one for bytearray)."""
    for value in PLAIN:
        if not (isinstance(value, bytearray) and protocol == 4):
            assert plain.loads(pickle.dumps(value, protocol)) == value


def test_plain_values_that_old_protocols_pickle_through_a_global_are_refused() -> None:
    for value in ({1}, frozenset({1}), b"x"):
        assert "not plain data" in _refused(pickle.dumps(value, 2))


def test_cloudpickle_results_of_plain_values_decode() -> None:
    shared = [1, 2]
    value = {"rewards": [0.5, 1.0], "ok": True, "pair": (shared, shared)}
    decoded = plain.loads(cloudpickle.dumps(value))
    assert decoded == value and decoded["pair"][0] is decoded["pair"][1]


class Marker:
    """What a hostile call returns: unpickling it would create a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.path}",))


def _refused(data: bytes) -> str:
    with pytest.raises(ResultRefused) as info:
        plain.loads(data)
    return str(info.value.details["reason"])


def test_reduce_payloads_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        for data in (pickle.dumps(Marker(str(marker)), protocol),
                     cloudpickle.dumps(Marker(str(marker)), protocol),
                     pickle.dumps([1, {"deep": (Marker(str(marker)),)}], protocol)):
            assert "not plain data" in _refused(data)
    assert not marker.exists()


def test_objects_classes_functions_and_exceptions_are_refused() -> None:
    for value in (Marker("x"), Marker, len, lambda: 1, ValueError("x"), object(), range(3),
                  complex(1, 2), Path("/"), memoryview(b"x").tobytes, pickle):
        assert "not plain data" in _refused(cloudpickle.dumps(value))


def test_hand_made_hostile_opcodes_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    touch = f"touch {marker}".encode()
    payloads = [
        b"cos\nsystem\n(S'" + touch + b"'\ntR.",  # GLOBAL + REDUCE, protocol 0
        b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c" + bytes([len(touch)]) + touch + b"\x85R.",
        b"(cos\nsystem\nS'" + touch + b"'\ni.",  # INST
        b"(cos\nsystem\nS'" + touch + b"'\no.",  # OBJ
        b"]}b.",  # BUILD on a plain list
        b"\x80\x02}\x81.",  # NEWOBJ
        b"P0\n.",  # PERSID
        b"\x80\x05\x97.",  # NEXT_BUFFER
    ]
    for data in payloads:
        _refused(data)
    assert not marker.exists()


def test_the_extension_registry_is_refused(tmp_path: Path) -> None:
    copyreg.add_extension("os", "system", 0xF1)
    try:
        data = b"\x80\x02\x82\xf1S'touch " + str(tmp_path / "ran").encode() + b"'\n\x85R."
        assert "EXT1" in _refused(data)
    finally:
        copyreg.remove_extension("os", "system", 0xF1)
    assert not (tmp_path / "ran").exists()


def test_sizes_are_capped_before_decoding() -> None:
    assert "bytes" in _refused(b"N" * (plain.MAX_BYTES + 1))
    # an empty set is one byte of pickle and 200 of memory
    bomb = b"\x80\x04(" + b"\x8f" * (plain.MAX_CONTAINERS + 1) + b"l."
    assert "containers" in _refused(bomb)
    # LONG_BINPUT 2**28 would make the C unpickler allocate a 4 GiB memo table
    assert "memo" in _refused(b"\x80\x02]r" + struct.pack("<I", 1 << 28) + b".")


def test_malformed_pickles_are_typed() -> None:
    for data in (b"", b"\x80\x05", b"\xff", b"]a.", b"\x80\x04\x95\xff\xff\xff\xff\x00\x00\x00\x00N.",
                 b"h\x05."):
        _refused(data)
