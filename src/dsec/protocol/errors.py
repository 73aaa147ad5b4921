"""Typed errors shared by the SDK and the server.

Every error has a stable ``code`` and an HTTP status; the server serialises an error as
``{"error": {"code": ..., "message": ..., "details": {...}}}`` and the SDK raises the
matching class again, so a caller never has to parse messages. ``details`` holds the
specifics (a path, a sandbox id, a quota).

The tree (catch ``DSecError`` for all of them)::

    DSecError (internal, 500)
    ├── InvalidRequest (400)            bad arguments; the server or the SDK refused them
    ├── Unauthorized (401), Forbidden (403)
    ├── not found (404): SandboxNotFound, ImageNotFound, ProcessNotFound, RouteNotFound,
    │                    TrajectoryNotFound, ProjectNotFound, SnapshotNotFound >
    │                    CheckpointNotFound,
    │                    FileNotFound (also a builtin FileNotFoundError)
    ├── CommandTimeout (408)            also a builtin TimeoutError
    ├── conflicts (409): TrajectoryExists, TrajectoryDiverged > StepInterrupted,
    │                    ProjectExists, DelegationExceeded, ProcessExited, StdinClosed
    ├── SandboxDied (410)               the sandbox ended under the call (details: reason)
    ├── refusals (413, 422, 429, 501, 503): PayloadTooLarge, IdempotencyKeyReused,
    │       UnsafeArchive, DigestMismatch, QuotaExceeded, StdinFull, NotSupported,
    │       CapacityExhausted, ServerUnavailable
    ├── PortUnavailable (502)           nothing answers on a sandbox's port (sandbox ports)
    ├── image registries (502): RegistryError > RegistryUnreachable, RegistryDenied
    ├── fn calls (422): RemoteError (the function raised), ResultRefused (not plain data)
    └── failures (500): SandboxError, ImageBuildError, SnapshotCorrupt; MethodNotAllowed (405)

Errors pickle (they cross Ray from a cluster edge to the API replica) and round-trip through
``to_json``/``error_from_json``.
"""

from __future__ import annotations

from typing import Any


class DSecError(Exception):
    code = "internal"
    status = 500

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_json(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}


class InvalidRequest(DSecError):
    code, status = "invalid_request", 400


class Unauthorized(DSecError):
    code, status = "unauthorized", 401


class SandboxNotFound(DSecError):
    code, status = "sandbox_not_found", 404


class SnapshotNotFound(DSecError):
    """No such snapshot, or none the key may see (a snapshot is its parent sandbox's
    project's)."""

    code, status = "snapshot_not_found", 404


class CheckpointNotFound(SnapshotNotFound):
    """A trajectory has no checkpoint at that step: it was not created with ``checkpoint=``,
    the step was not checkpointed (``checkpoint=k``), or its snapshot was deleted. A fork at
    that step never falls back to re-executing the steps."""

    code, status = "checkpoint_not_found", 404


class ImageNotFound(DSecError):
    code, status = "image_not_found", 404


class ImageBuildError(DSecError):
    """A build step failed; the message ends with the step's last lines of output."""

    code, status = "image_build_failed", 500


class FileNotFound(DSecError, FileNotFoundError):
    """No such file or directory in the sandbox (``details["path"]``); also a builtin
    ``FileNotFoundError``, so ``except FileNotFoundError`` catches it."""

    code, status = "file_not_found", 404


class ProcessNotFound(DSecError):
    code, status = "process_not_found", 404


class ProcessExited(DSecError):
    """Input, a close of stdin or a resize for a process that has already ended."""
    code, status = "process_exited", 409


class StdinClosed(DSecError):
    """Input for a process whose stdin is closed: it was started without ``stdin_open``, it
    was closed (``close_stdin``), or the process closed it itself."""
    code, status = "stdin_closed", 409


class StdinFull(DSecError):
    """The process has not read the input already sent (1 MiB waits in the sandbox) and did
    not make room in time; nothing of this input was taken. Send it again later."""
    code, status = "stdin_full", 429


class RouteNotFound(DSecError):
    """No API route has this path (a typo, or a route of a newer server)."""

    code, status = "route_not_found", 404


class MethodNotAllowed(DSecError):
    code, status = "method_not_allowed", 405


class PayloadTooLarge(DSecError):
    """The request body exceeds the server's limit (``details["limit"]`` bytes)."""

    code, status = "payload_too_large", 413


class SandboxDied(DSecError):
    """The sandbox stopped underneath a call (crashed, OOM-killed its agent, TTL expired)."""

    code, status = "sandbox_died", 410


class CommandTimeout(DSecError, TimeoutError):
    """A command or fn call ran past its ``timeout_s`` and was killed; also a builtin
    ``TimeoutError``. From ``Sandbox.run``, ``.result`` holds the output it made."""

    code, status = "command_timeout", 408


class CapacityExhausted(DSecError):
    code, status = "capacity_exhausted", 503


class NotSupported(DSecError):
    code, status = "not_supported", 501


class ServerUnavailable(DSecError):
    """The dsec server could not be reached or dropped the connection mid-call."""

    code, status = "server_unavailable", 503


class SandboxError(DSecError):
    """The substrate failed to start or serve a sandbox (runtime error, agent error)."""

    code, status = "sandbox_error", 500


class SnapshotCorrupt(DSecError):
    """A snapshot's copy in the shared snapshot directory is missing, truncated or altered:
    refused, and nothing was made from it."""

    code, status = "snapshot_corrupt", 500


class TrajectoryNotFound(DSecError):
    code, status = "trajectory_not_found", 404


class TrajectoryExists(DSecError):
    """``create(trajectory=...)`` names a trajectory that already exists: resume it instead."""

    code, status = "trajectory_exists", 409


class TrajectoryDiverged(DSecError):
    """A call differs from the one logged at the same step of the trajectory. ``details``
    hold ``trajectory``, ``step``, ``logged`` and ``issued`` (each ``{"op", "params",
    "payload"}``). Resume with ``on_divergence="fork"`` to continue in a fresh sandbox."""

    code, status = "trajectory_diverged", 409


class StepInterrupted(TrajectoryDiverged):
    """The logged step was still running when the server that ran it stopped, so whether (and
    how far) it changed the sandbox is unknown. Fork (``on_divergence="fork"``) or replay."""

    code, status = "step_interrupted", 409


class Forbidden(DSecError):
    """The key may see the project but not change it (e.g. its own or an ancestor's quota)."""

    code, status = "forbidden", 403


class ProjectNotFound(DSecError):
    """No such project, or none the key may see."""

    code, status = "project_not_found", 404


class ProjectExists(DSecError):
    code, status = "project_exists", 409


class QuotaExceeded(DSecError):
    """Admitting the sandbox would take the project past its quota (details: ``project``,
    ``resource``, ``quota``, ``used``, ``delegated``, ``asked``). Retry when some end."""

    code, status = "quota_exceeded", 429


class DelegationExceeded(DSecError):
    """A quota change would break ``use + children's quotas <= quota`` for a project (details:
    ``project``, ``resource``, ``quota``, ``used``, ``delegated``, ``asked``)."""

    code, status = "delegation_exceeded", 409

class IdempotencyKeyReused(DSecError):
    """The ``Idempotency-Key`` of a create was used before for a different request (another
    image, options or front-end): a key names one create. Nothing was created."""

    code, status = "idempotency_key_reused", 422


class UnsafeArchive(DSecError):
    """An archive that came out of a sandbox, or an image layer from a registry or an archive,
    would write outside its destination (an absolute name, ``..``, a link out, a device, a
    member under a symlink) or past its caps (members, bytes). Nothing is written outside the
    destination; ``details`` name the member (or the layer)."""

    code, status = "unsafe_archive", 422


class DigestMismatch(DSecError):
    """Image content (a manifest, a config, a layer blob or its unpacked tar) does not match
    the digest that names it: refused, and nothing of it was stored (``details``: ``expected``,
    ``got``)."""

    code, status = "digest_mismatch", 422


class RegistryError(DSecError):
    """An image registry answered a pull with an error or with something dsec does not take
    (a schema 1 manifest, too many layers, a giant config); ``details["registry"]`` names it."""

    code, status = "registry_error", 502


class RegistryUnreachable(RegistryError):
    """The registry could not be reached (connection refused, DNS, TLS, timeout)."""

    code, status = "registry_unreachable", 502


class RegistryDenied(RegistryError):
    """The registry refused the credentials dsec has for it, or wants some and dsec has none
    (see docs/IMAGES.md: the docker config file or ``DSEC_REGISTRY_AUTH``)."""

    code, status = "registry_denied", 502


class RemoteError(DSecError):
    """The function of an fn call raised. ``remote_type`` is the exception's qualified type
    name (``builtins.ZeroDivisionError``), ``traceback`` its formatted remote traceback."""

    code, status = "remote_error", 422

    @property
    def remote_type(self) -> str:
        return str(self.details.get("remote_type", ""))

    @property
    def traceback(self) -> str:
        return str(self.details.get("traceback", ""))


class ResultRefused(DSecError):
    """An fn call's result is not plain data (or is too big to decode safely), and the caller
    did not opt in to unpickling it (``trusted_result=True``); ``details["reason"]`` says why.
    Raised by the SDK: nothing of the result was imported or called."""

    code, status = "result_refused", 422


class PortUnavailable(DSecError):
    """Nothing listens on the sandbox's port (or it did not accept in time, or the sandbox has
    too many port connections open): ``details`` has ``sandbox_id``, ``port`` and ``reason``."""

    code, status = "port_unavailable", 502


ERRORS: dict[str, type[DSecError]] = {
    cls.code: cls
    for cls in (
        DSecError,
        InvalidRequest,
        Unauthorized,
        SandboxNotFound,
        SnapshotNotFound,
        CheckpointNotFound,
        ImageNotFound,
        ImageBuildError,
        FileNotFound,
        ProcessNotFound,
        ProcessExited,
        StdinClosed,
        StdinFull,
        RouteNotFound,
        MethodNotAllowed,
        PayloadTooLarge,
        SandboxDied,
        CommandTimeout,
        CapacityExhausted,
        NotSupported,
        ServerUnavailable,
        SandboxError,
        SnapshotCorrupt,
        TrajectoryNotFound,
        TrajectoryExists,
        TrajectoryDiverged,
        StepInterrupted,
        Forbidden,
        ProjectNotFound,
        ProjectExists,
        QuotaExceeded,
        DelegationExceeded,
        RemoteError,
        ResultRefused,
        PortUnavailable,
        UnsafeArchive,
        IdempotencyKeyReused,
        DigestMismatch,
        RegistryError,
        RegistryUnreachable,
        RegistryDenied,
    )
}


def error_from_json(body: dict[str, Any]) -> DSecError:
    err = body.get("error") or {}
    cls = ERRORS.get(err.get("code", ""), DSecError)
    return cls(err.get("message", "unknown error"), **(err.get("details") or {}))
