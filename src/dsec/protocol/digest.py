"""What a call is, canonically: its operation, its parameters and its byte payload, and the
digest that identifies it at a position of a trajectory.

Shared by the SDK and the server: the SDK digests a call to fast-forward it from a log it
prefetched, the server digests it to match it against the log; both must agree to the bit.
A request is digested as the client expressed it (after the wire model filled in defaults):
``read_file("a.txt")`` and ``read_file("/work/a.txt")`` are different calls. Parameters are
canonical JSON (sorted keys, no spaces); the payload (file data, tar, stdin) enters as its
SHA-256 and size, so digesting a large write costs one hash.

Pure: the standard library, the wire models and the table of operations only.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from pydantic import BaseModel

from .models import ExecRequest
from .ops import BY_METHOD, STEP_NAMES, STREAM_STEPS, Operation

# Operations, as logged (the table's step names). ``exec`` covers both ``run`` and ``stream``
# (one result, two ways of receiving it); ``output`` is attaching to a background process.
STREAM_OPS = STREAM_STEPS
OPS = STEP_NAMES


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


class StepRequest:
    """A call: ``op``, ``params`` (JSON) and ``payload`` (bytes or None). Immutable by
    convention; its canonical text and digest are computed once, when first asked for.
    ``arguments``: the edge call's own arguments when the request was made from them (a live
    call), so running it needs no second validation of what the route validated already."""

    __slots__ = ("op", "params", "payload", "arguments", "_canonical", "_digest")

    def __init__(self, op: str, params: dict[str, Any], payload: bytes | None = None,
                 arguments: dict[str, Any] | None = None) -> None:
        self.op = op
        self.params = params
        self.payload = payload
        self.arguments = arguments
        self._canonical: str | None = None
        self._digest: str | None = None

    def __repr__(self) -> str:
        return f"StepRequest({self.op!r}, {self.params!r}, payload={self.payload_ref})"

    @property
    def payload_ref(self) -> dict[str, Any] | None:
        if self.payload is None:
            return None
        return {"size": len(self.payload), "sha256": hashlib.sha256(self.payload).hexdigest()}

    @property
    def canonical(self) -> str:
        """The text the digest is the SHA-256 of; the log stores it as the request."""
        if self._canonical is None:
            self._canonical = canonical_json({"op": self.op, "params": self.params,
                                              "payload": self.payload_ref})
        return self._canonical

    @property
    def digest(self) -> str:
        if self._digest is None:
            self._digest = "sha256:" + hashlib.sha256(self.canonical.encode()).hexdigest()
        return self._digest

    def describe(self) -> dict[str, Any]:
        """The request without its payload bytes, for errors and reports."""
        return {"op": self.op, "params": self.params, "payload": self.payload_ref}


def step_request(op: Operation, arguments: dict[str, Any]) -> StepRequest:
    """The logged form of a call of ``op`` with ``arguments`` (every parameter, by name):
    its parameters as the caller gave them, the payload parameter as the payload, and an
    ExecRequest as its fields with its stdin as the payload."""
    assert op.step is not None, f"{op.method} is not a trajectory step"
    if op.exec_param is not None:
        req: ExecRequest = arguments[op.exec_param]
        stdin = None if req.stdin_b64 is None else base64.b64decode(req.stdin_b64)
        # stdin_open enters only when set: exec steps logged before it existed keep their digest
        exclude = {"stdin_b64"} if req.stdin_open else {"stdin_b64", "stdin_open"}
        return StepRequest(op.step, req.model_dump(exclude=exclude), stdin, arguments)
    params = {p.name: _plain(arguments[p.name]) for p in op.params if p.name != op.payload}
    return StepRequest(op.step, params, None if op.payload is None else arguments[op.payload],
                       arguments)


def _plain(value: Any) -> Any:
    return value.model_dump() if isinstance(value, BaseModel) else value


def step(method: str, **arguments: Any) -> StepRequest:
    """``step_request`` of the edge method ``method`` (the SDK's way to name a call)."""
    return step_request(BY_METHOD[method], arguments)


def call_arguments(op: Operation, request: StepRequest) -> dict[str, Any]:
    """The inverse of ``step_request``: the keyword arguments of the edge call a logged
    request was made from."""
    if request.arguments is not None:
        return request.arguments
    if op.exec_param is not None:
        stdin = None if request.payload is None else base64.b64encode(request.payload).decode()
        return {op.exec_param: ExecRequest(**request.params, stdin_b64=stdin)}
    arguments = dict(request.params)
    for p in op.params:  # a request model (a terminal's) is logged as its fields
        if isinstance(p.type, type) and issubclass(p.type, BaseModel):
            arguments[p.name] = p.type(**arguments[p.name])
    if op.payload is not None:
        arguments[op.payload] = request.payload or b""
    return arguments

