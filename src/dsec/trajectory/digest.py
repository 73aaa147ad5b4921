"""What a call is, canonically: its operation, its parameters and its byte payload, and the
digest that identifies it at a position of a trajectory.

Shared by the SDK and the server: the SDK digests a call to fast-forward it from a log it
prefetched, the server digests it to match it against the log; both must agree to the bit.
A request is digested as the client expressed it (after the wire model filled in defaults):
``read_file("a.txt")`` and ``read_file("/work/a.txt")`` are different calls. Parameters are
canonical JSON (sorted keys, no spaces); the payload (file data, tar, stdin) enters as its
SHA-256 and size, so digesting a large write costs one hash.

Pure: the standard library and the wire models only.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from ..client.models import ExecRequest

# Operations, as logged. ``exec`` covers both ``run`` and ``stream`` (one result, two ways of
# receiving it); ``output`` is attaching to a background process.
STREAM_OPS = frozenset({"exec", "output"})
OPS = frozenset({"exec", "start", "processes", "output", "signal", "read", "write", "remove",
                 "list", "mkdir", "stat", "download", "upload"})


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


class StepRequest:
    """A call: ``op``, ``params`` (JSON) and ``payload`` (bytes or None). Immutable by
    convention; its canonical text and digest are computed once, when first asked for."""

    __slots__ = ("op", "params", "payload", "_canonical", "_digest")

    def __init__(self, op: str, params: dict[str, Any], payload: bytes | None = None) -> None:
        self.op = op
        self.params = params
        self.payload = payload
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


def exec_request(op: str, req: ExecRequest) -> StepRequest:
    """``exec`` (run or stream) or ``start``: the whole ExecRequest, stdin as the payload."""
    params = req.model_dump(exclude={"stdin_b64"})
    stdin = None if req.stdin_b64 is None else base64.b64decode(req.stdin_b64)
    return StepRequest(op, params, stdin)


def exec_model(request: StepRequest) -> ExecRequest:
    """The ExecRequest a logged ``exec``/``start`` request was made from."""
    stdin = None if request.payload is None else base64.b64encode(request.payload).decode()
    return ExecRequest(**request.params, stdin_b64=stdin)


def call_request(op: str, payload: bytes | None = None, **params: Any) -> StepRequest:
    """Any other call: its parameters by name (path, mode, append, recursive, parents,
    process, signal), exactly as the route receives them."""
    return StepRequest(op, params, payload)
