"""Wire models shared by the SDK and the API server.

Bytes travel as base64 inside JSON (``*_b64`` fields) so that any output, binary included,
round-trips exactly; the SDK turns them back into ``bytes`` and offers text helpers.
"""

from __future__ import annotations

import base64
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Substrate = Literal["container", "fn", "microvm", "vm"]
Runtime = Literal["crun", "runc", "runsc"]
SandboxState = Literal["starting", "running", "stopped", "expired", "died"]

DEFAULT_MAX_OUTPUT = 16 << 20


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateRequest(_Model):
    substrate: Substrate = "container"
    image: str = "debian-minbase"
    cpu: float = Field(1.0, gt=0, le=64)
    memory_mb: int = Field(512, ge=32, le=1 << 20)
    pids: int = Field(512, ge=16, le=1 << 16, description="maximum number of processes")
    disk_mb: int = Field(1024, ge=16, le=1 << 20, description="size of the writable layer")
    ttl_s: int = Field(600, ge=1, le=7 * 86400)
    network: str = Field("none", description="only 'none' (loopback only) is served so far")
    env: dict[str, str] = Field(default_factory=dict)
    runtime: Runtime | None = Field(None, description="container runtime; the edge default if unset")
    labels: dict[str, str] = Field(default_factory=dict)


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


class TtlRequest(_Model):
    ttl_s: int = Field(ge=1, le=7 * 86400)


class ExecRequest(_Model):
    command: str | list[str] = Field(description="a shell string (run by /bin/sh -c) or an argv list")
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    stdin_b64: str | None = None
    timeout_s: float | None = Field(60.0, gt=0, description="None waits forever")
    max_output_bytes: int = Field(DEFAULT_MAX_OUTPUT, ge=0, le=1 << 30, description="cap per stream")
    session: str | None = Field(None, description="named shell session whose cwd and env persist")


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


class SignalRequest(_Model):
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


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
