"""Decoding an fn call's result as plain data: the default of ``call`` and ``map``.

A call's result is a pickle made by the code that ran in the call, which may be a model's
code: bytes an attacker shapes. ``pickle.loads`` on such bytes runs whatever the pickle names
(``__reduce__``), in the caller's process. This decoder admits only pickles of builtin plain
values (None, bool, int, float, str, bytes, bytearray, list, tuple, dict, set, frozenset)
and never imports or calls anything: every opcode that names a global, calls or builds an
object, reaches the extension registry or refers to persistent or out-of-band data is
refused before decoding starts (and ``find_class`` refuses again while decoding). Sizes are
capped so that decoding cannot take unbounded memory: the pickle's length, its opcode count,
the containers it makes (an empty set is 1 byte of pickle, 200 of memory), and memo indices
(``LONG_BINPUT 2**28`` would make the C unpickler allocate a 4 GiB memo table).
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any, NoReturn

from ..protocol.errors import ResultRefused

MAX_BYTES = 64 << 20
MAX_OPS = 1 << 23
MAX_CONTAINERS = 1 << 21

_DATA = {
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
    "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
    "APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS",
    "GET", "BINGET", "LONG_BINGET", "MEMOIZE",
}
_CONTAINERS = {"EMPTY_LIST", "LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
               "EMPTY_DICT", "DICT", "EMPTY_SET", "FROZENSET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}


def loads(data: bytes) -> Any:
    """The plain value pickled in ``data``; ``ResultRefused`` for anything else."""
    if len(data) > MAX_BYTES:
        _refuse(f"the result is {len(data)} bytes, more than the {MAX_BYTES} a plain result may be")
    _scan(data)
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except ResultRefused:
        raise
    except Exception as exc:  # noqa: BLE001  (whatever a malformed pickle makes pickle raise)
        _refuse(f"the result is not a valid pickle: {type(exc).__name__}: {exc}")


def _scan(data: bytes) -> None:
    ops = containers = 0
    try:
        for op, arg, _ in pickletools.genops(data):
            ops += 1
            if op.name in _CONTAINERS:
                containers += 1
            elif op.name in _PUTS:
                if not isinstance(arg, int) or not 0 <= arg < ops:
                    _refuse(f"the result's pickle stores memo entry {arg!r} out of order")
            elif op.name not in _DATA:
                _refuse(f"the result is not plain data: its pickle uses {op.name}")
            if ops > MAX_OPS or containers > MAX_CONTAINERS:
                _refuse(f"the result has more than {MAX_OPS} pickle operations or "
                        f"{MAX_CONTAINERS} containers")
    except ValueError as exc:  # genops: an unknown opcode, a truncated argument
        _refuse(f"the result is not a valid pickle: {exc}")


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> NoReturn:
        _refuse(f"the result is not plain data: it names {module}.{name}")

    def persistent_load(self, pid: Any) -> NoReturn:
        _refuse("the result is not plain data: it refers to a persistent object")


def _refuse(why: str) -> NoReturn:
    raise ResultRefused(f"{why}; return plain data (None, bool, int, float, str, bytes, "
                        "list, tuple, dict, set) or call with trusted_result=True",
                        reason=why)
