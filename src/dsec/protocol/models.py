"""Wire models shared by the SDK and the API server.

Bytes travel as base64 inside JSON (``*_b64`` fields) so that any output, binary included,
round-trips exactly; the SDK turns them back into ``bytes`` and offers text helpers.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from .rules import parse_rule

Substrate = Literal["container", "fn", "microvm", "vm"]
Runtime = Literal["crun", "runc", "runsc"]
SandboxState = Literal["starting", "running", "paused", "stopped", "expired", "died"]

DEFAULT_MAX_OUTPUT = 16 << 20
DEFAULT_DISK_MB = 1024  # the size warm-pool sandboxes and spare disk files have
# A trajectory id: path-like segments ("run-7/ep-123"), each starting with a letter, digit or
# underscore, so no segment is "-", "." or "..": "/-/" separates an id from a sub-resource.
TRAJECTORY_ID = r"^[A-Za-z0-9_][A-Za-z0-9_.@+=-]*(/[A-Za-z0-9_][A-Za-z0-9_.@+=-]*)*$"
STEP_MAX = (1 << 63) - 1  # steps and generations are SQLite integers
TRAJECTORY_TTL_MAX = 100 * 365 * 86400  # a century: a number a time stamp can still add
SNAPSHOT_ID = r"^sn-[A-Za-z0-9-]+$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def lone_surrogate(value: Any) -> str | None:
    """The first string in ``value`` (keys included, at any depth; no recursion) that is not
    text: JSON's ``"\\udc80"`` escape decodes to a lone surrogate, which no UTF-8 encoder (the
    response's, the database's, the agent's) accepts further on. None when all are text."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item
        elif isinstance(item, dict):
            pending += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            pending += item
    return None


class _Request(_Model):
    """What a client sends: numbers are finite (no JSON ``Infinity``/``NaN``) and strings are
    text (no lone surrogates), checked here once for every field of every request, so a bad
    input is a typed 400 before anything is created."""

    model_config = ConfigDict(allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        bad = lone_surrogate(data)
        if bad is not None:
            raise ValueError(f"strings must be valid Unicode text; {ascii(bad)[:80]} holds a "
                             "lone surrogate")
        return data


class NetworkPolicy(_Request):
    """Egress a sandbox may open (everything else is refused; replies always pass).

    ``services`` names entries of the edge's service table (``{"pypi": True, "npm": False}``:
    only true ones open anything); ``allow`` holds raw rules: ``"10.1.2.3:443"``,
    ``"192.168.0.0/24"``, ``"10.1.2.3"`` (any port), ``"host.name:80"`` (resolved on the
    host when the policy is applied and pinned in the sandbox's /etc/hosts). As a shorthand,
    service names may be given at the top level: ``{"pypi": True, "allow": [...]}``."""

    services: dict[str, StrictBool] = Field(default_factory=dict)
    allow: list[str] = Field(default_factory=list, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, list):
            return {"allow": data}
        if isinstance(data, dict):
            named = {k: v for k, v in data.items() if k not in ("services", "allow")}
            if named:
                rest = {k: v for k, v in data.items() if k in ("services", "allow")}
                return {**rest, "services": {**rest.get("services", {}), **named}}
        return data

    @field_validator("allow")
    @classmethod
    def _rules(cls, rules: list[str]) -> list[str]:
        for rule in rules:
            parse_rule(rule)  # ValueError: a validation error naming the rule
        return rules


Network = Literal["none"] | NetworkPolicy


class NetworkRequest(_Request):
    network: Network = Field(description="'none' (loopback only) or a NetworkPolicy")


class CreateRequest(_Request):
    substrate: Substrate = "container"
    image: str = "debian-minbase"
    cpu: float = Field(1.0, gt=0, le=64)
    memory_mb: int = Field(512, ge=32, le=1 << 20)
    pids: int = Field(512, ge=16, le=1 << 16, description="maximum number of processes")
    disk_mb: int = Field(DEFAULT_DISK_MB, ge=16, le=1 << 20, description="size of the writable layer")
    ttl_s: int = Field(600, ge=1, le=7 * 86400,
                       description="lifetime in seconds, counted from when it is running")
    network: Network = Field("none", description="'none' (loopback only, the default) or a "
                                                 "NetworkPolicy (egress allowlist)")
    env: dict[str, str] = Field(default_factory=dict)
    runtime: Runtime | None = Field(None, description="container runtime; the edge default if unset")
    labels: dict[str, str] = Field(default_factory=dict)
    trajectory: str | None = Field(None, max_length=256, pattern=TRAJECTORY_ID,
                                   description="log every call of the sandbox under this new "
                                               "trajectory id (see Trajectories)")
    snapshot: str | None = Field(None, max_length=64, pattern=SNAPSHOT_ID,
                                 description="start from this snapshot's file system (its "
                                             "image and disk size are the snapshot's)")
    checkpoint: Literal["every_step"] | Annotated[StrictInt, Field(ge=1, le=STEP_MAX)] | None = Field(
        None, description="with a trajectory: snapshot the file system after every logged "
                          "step ('every_step') or every k-th, so that a fork at a step "
                          "restores it instead of re-executing the steps before")

    trajectory_ttl_s: StrictInt | None = Field(
        None, ge=1, le=TRAJECTORY_TTL_MAX, description="with a trajectory: delete it (and "
        "stop its sandbox) this many seconds after it was created, as `delete_trajectory` "
        "does; its forks keep the same TTL (default: the server's --trajectory-ttl-s)")

    @model_validator(mode="after")
    def _checkpoint_needs_trajectory(self) -> CreateRequest:
        if self.checkpoint is not None and self.trajectory is None:
            raise ValueError("checkpoint needs a trajectory (checkpoints are its steps')")
        if self.trajectory_ttl_s is not None and self.trajectory is None:
            raise ValueError("trajectory_ttl_s needs a trajectory")
        return self

    def checkpointed(self, step: int) -> bool:
        """Whether step ``step`` (0: the fresh sandbox) is checkpointed."""
        return checkpointed(self.checkpoint, step)


def checkpointed(checkpoint: Literal["every_step"] | int | None, step: int) -> bool:
    """Whether a trajectory created with ``checkpoint`` checkpoints step ``step``."""
    if checkpoint is None:
        return False
    return checkpoint == "every_step" or step % checkpoint == 0


class SandboxInfo(_Model):
    id: str
    substrate: Substrate
    image: str
    image_digest: str
    state: SandboxState
    edge: str
    created_at: float
    expires_at: float
    cpu: float
    memory_mb: int
    labels: dict[str, str] = Field(default_factory=dict)
    reason: str | None = Field(None, description="why the sandbox is no longer running")
    trajectory: str | None = None
    network: Network = "none"


SnapshotMode = Literal["filesystem", "full"]


MAX_SNAPSHOT_TTL_S = 365 * 86400


class SnapshotRequest(_Request):
    mode: SnapshotMode = Field("filesystem", description="'filesystem': the writable layer "
                               "(processes start fresh from it); 'full': memory and processes "
                               "too (microvm and vm sandboxes)")
    previous: str | None = Field(None, max_length=64, pattern=SNAPSHOT_ID,
                                 description="a snapshot of this sandbox: if nothing was "
                                             "written to its disk since, it is the answer "
                                             "(no copy is made)")
    ttl_s: int | None = Field(None, ge=1, le=MAX_SNAPSHOT_TTL_S,
                              description="deleted by the server this many seconds after it "
                                          "is taken; none: kept until deleted")


class RollbackRequest(_Request):
    snapshot: str = Field(max_length=64, description="a snapshot of this same sandbox")


class Snapshot(_Model):
    id: str
    mode: SnapshotMode
    size_bytes: int = Field(description="bytes the snapshot holds on the host")
    sandbox_id: str = Field(description="the sandbox it was taken of (its parent)")
    image: str
    created_at: float
    expires_at: float | None = Field(None, description="when the server deletes it (its TTL)")


class TtlRequest(_Request):
    ttl_s: int = Field(ge=1, le=7 * 86400)


class ExecRequest(_Request):
    command: str | list[str] = Field(
        description="a shell string (run by dsec's own /.dsec/bin/sh -c) or an argv list")
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    stdin_b64: str | None = None
    timeout_s: float | None = Field(60.0, gt=0, description="None waits forever")
    max_output_bytes: int = Field(DEFAULT_MAX_OUTPUT, ge=0, le=1 << 30, description="cap per stream")
    session: str | None = Field(None, description="named shell session whose cwd and env persist")
    stdin_open: bool = Field(False, description="a background process's stdin stays open "
                             "(after stdin_b64) for send_stdin until close_stdin")

    @field_validator("stdin_b64")
    @classmethod
    def _base64(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                base64.b64decode(value, validate=True)
            except ValueError:
                raise ValueError("stdin_b64 must be standard base64") from None
        return value


class ExecResult(_Model):
    exit_code: int
    signal: int = 0
    stdout_b64: str = ""
    stderr_b64: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    oom_killed: bool = False
    duration_ms: int = 0

    @property
    def stdout_bytes(self) -> bytes:
        return base64.b64decode(self.stdout_b64)

    @property
    def stderr_bytes(self) -> bytes:
        return base64.b64decode(self.stderr_b64)


class ProcessInfo(_Model):
    id: str
    pid: int
    command: str
    running: bool
    exit_code: int | None = None
    signal: int = 0
    pty: bool = False


class PtyRequest(_Request):
    command: str | list[str] = Field(
        "bash", description="a shell string (run by dsec's own /.dsec/bin/sh -c) or an argv list")
    cols: int = Field(80, ge=1, le=10_000)
    rows: int = Field(24, ge=1, le=10_000)
    env: dict[str, str] = Field(default_factory=dict, description="TERM is xterm-256color "
                                "unless set here or in the sandbox's env")
    cwd: str | None = None
    timeout_s: float | None = Field(None, gt=0, description="None runs until it exits or is killed")
    max_output_bytes: int = Field(DEFAULT_MAX_OUTPUT, ge=0, le=1 << 30,
                                  description="the most recent output kept for replay")


class ResizeRequest(_Request):
    cols: int = Field(ge=1, le=10_000)
    rows: int = Field(ge=1, le=10_000)


class SignalRequest(_Request):
    signal: int = Field(15, ge=1, le=64)


class FileEntry(_Model):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


class KeyInfo(_Model):
    id: str
    name: str
    created_at: float


class KeyCreated(KeyInfo):
    key: str = Field(description="the secret; shown once")


StepStatus = Literal["running", "interrupted", "ok", "error"]


class GenerationInfo(_Model):
    """One sandbox's stretch of a trajectory: generation 1 is the first sandbox; a fork (or a
    replay with ``attach``) starts the next, with the log's first steps copied into it."""

    generation: int
    sandbox_id: str
    image: str
    image_digest: str
    started_at: float
    forked_at_step: int | None = None
    reason: str | None = None
    replay_differences: list[int] = Field(default_factory=list,
                                          description="copied steps whose replay differed")
    sandbox_state: SandboxState | None = None
    sandbox_reason: str | None = None


class TrajectoryInfo(_Model):
    id: str
    generation: int
    sandbox: SandboxInfo
    created_at: float
    created_by: str | None = Field(None, description="API key id")
    steps: int = Field(description="logged steps of the current generation")
    last_step: int = Field(description="highest logged step of the current generation (0: none)")
    generations: list[GenerationInfo] = Field(default_factory=list)
    expires_at: float | None = Field(None, description="when its own TTL (`trajectory_ttl_s`) "
                                     "deletes it; None: kept until deleted, or the server's TTL")


class StepRecord(_Model):
    """One logged call. ``request`` is ``{"op", "params", "payload"}`` (the payload as
    ``{"size", "sha256"}``), the canonical text of which ``digest`` is the SHA-256.
    ``outcome`` is ``{"value", "bytes", "chunks"}`` or ``{"error": {...}}``, byte fields as
    ``{"size", "b64"}`` (inline) or ``{"size", "sha256"}`` (in the blob area); None while
    the step runs (or if it was interrupted)."""

    trajectory: str
    generation: int
    step: int
    op: str
    digest: str
    request: dict[str, Any]
    status: StepStatus
    outcome: dict[str, Any] | None = None
    sandbox_id: str
    caller: str | None = None
    started_at: float
    ended_at: float | None = None
    checkpoint: str | None = Field(None, description="the snapshot holding the file system "
                                                     "after this step, if it was checkpointed")


class StepPage(_Model):
    trajectory: str
    generation: int
    steps: list[StepRecord]
    next_after: int | None = Field(None, description="pass as ``after`` for the next page")


class ForkTrajectoryRequest(_Request):
    at_step: int = Field(ge=0, le=STEP_MAX, description="the checkpointed step to fork at "
                                                        "(0: the fresh sandbox)")
    n: int = Field(1, ge=1, le=256, description="how many forks")


class ReplayRequest(_Request):
    into: Literal["new"] = Field("new", description="a fresh sandbox of the trajectory's image")
    generation: int | None = Field(None, ge=0, le=STEP_MAX,
                                   description="generation to replay; default: current")
    upto: int | None = Field(None, ge=0, le=STEP_MAX, description="last step to replay; default: all")
    attach: bool = Field(False, description="make the new sandbox the trajectory's (a new "
                                            "generation): continue the trajectory there")
    restore: bool = Field(True, description="start from the newest checkpoint at or before "
                          "``upto`` and replay only the steps after it; False re-executes every "
                          "step (a check of determinism)")


class StepDiff(_Model):
    step: int
    op: str
    same: bool
    fields: list[str] = Field(default_factory=list, description="what differs")
    logged: dict[str, Any] = Field(default_factory=dict)
    replayed: dict[str, Any] = Field(default_factory=dict)


class ReplayReport(_Model):
    trajectory: str
    generation: int = Field(description="generation that was replayed")
    sandbox: SandboxInfo
    attached_generation: int | None = Field(None, description="set when ``attach`` was asked")
    restored_step: int | None = Field(None, description="the checkpoint the new sandbox "
                                      "started from; only the steps after it were replayed")
    steps: list[StepDiff]

    @property
    def differences(self) -> list[StepDiff]:
        return [s for s in self.steps if not s.same]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
