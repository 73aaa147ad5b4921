"""The asyncio SDK: ``DSecClient`` creates sandboxes; a ``Sandbox`` runs commands and touches
files; a ``Process`` is a background command.

    async with dsec.DSecClient() as client:
        sb = await client.create(image="python-3.11")
        r = await sb.run("python3 -c 'print(6*7)'")
        assert r.stdout == "42\\n"
"""

from __future__ import annotations

import asyncio
import base64
import io
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import CommandTimeout, DSecError, FileNotFound, InvalidRequest
from .models import (CreateRequest, ExecRequest, ExecResult, FileEntry, ProcessInfo,
                     SandboxInfo, b64)
from .transport import Transport


@dataclass(frozen=True)
class CommandResult:
    """What a finished command left: bytes are exact; ``stdout``/``stderr`` decode them."""

    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    signal: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    oom_killed: bool = False
    duration_ms: int = 0

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @classmethod
    def from_wire(cls, r: ExecResult, stdout: bytes | None = None,
                  stderr: bytes | None = None) -> CommandResult:
        return cls(exit_code=r.exit_code, signal=r.signal,
                   stdout_bytes=r.stdout_bytes if stdout is None else stdout,
                   stderr_bytes=r.stderr_bytes if stderr is None else stderr,
                   stdout_truncated=r.stdout_truncated, stderr_truncated=r.stderr_truncated,
                   timed_out=r.timed_out, oom_killed=r.oom_killed, duration_ms=r.duration_ms)


@dataclass(frozen=True)
class OutputChunk:
    stream: Literal["stdout", "stderr"]
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


M = TypeVar("M", bound=BaseModel)


def _validated(model: type[M], **fields: Any) -> M:
    """Check a request before sending it, raising the same typed error the server would."""
    try:
        return model(**fields)
    except ValidationError as exc:
        raise InvalidRequest(f"invalid {model.__name__}: {exc.errors(include_url=False)}") from None


def _timeout_error(result: CommandResult, timeout_s: float | None) -> CommandTimeout:
    err = CommandTimeout(f"command timed out after {timeout_s}s; its process group was killed",
                         timeout_s=timeout_s)
    err.result = result  # type: ignore[attr-defined]
    return err


class OutputStream:
    """Iterate for output chunks as they arrive; ``result`` holds the outcome afterwards."""

    def __init__(self, events: AsyncIterator[dict[str, Any]], timeout_s: float | None) -> None:
        self._events = events
        self._timeout_s = timeout_s
        self._out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.result: CommandResult | None = None

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[OutputChunk]:
        async for event in self._events:
            if event["type"] == "result":
                wire = ExecResult.model_validate(event["result"])
                self.result = CommandResult.from_wire(wire, b"".join(self._out["stdout"]),
                                                      b"".join(self._out["stderr"]))
                if wire.timed_out:
                    raise _timeout_error(self.result, self._timeout_s)
            else:
                chunk = OutputChunk(event["type"], base64.b64decode(event["data"]))
                self._out[chunk.stream].append(chunk.data)
                yield chunk

    async def wait(self) -> CommandResult:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result


class Process:
    """A command started in the background; its output is kept so it can be read again."""

    def __init__(self, sandbox: Sandbox, info: ProcessInfo) -> None:
        self.sandbox = sandbox
        self.id = info.id
        self.pid = info.pid
        self.command = info.command

    def stream(self) -> OutputStream:
        """Everything the process printed from its start, then live output until it ends."""
        return OutputStream(self.sandbox._t.ndjson(
            "GET", f"{self.sandbox._path}/processes/{self.id}/output"), None)

    async def wait(self) -> CommandResult:
        return await self.stream().wait()

    async def signal(self, sig: int) -> None:
        await self.sandbox._t.request("POST", f"{self.sandbox._path}/processes/{self.id}/signal",
                                      json={"signal": sig})

    async def kill(self) -> None:
        await self.signal(9)


class Session:
    """A named shell session: cwd and exported environment persist between its commands."""

    def __init__(self, sandbox: Sandbox, name: str) -> None:
        self.sandbox = sandbox
        self.name = name

    async def run(self, command: str, **kwargs: Any) -> CommandResult:
        return await self.sandbox.run(command, session=self.name, **kwargs)

    def stream(self, command: str, **kwargs: Any) -> OutputStream:
        return self.sandbox.stream(command, session=self.name, **kwargs)


class Sandbox:
    def __init__(self, transport: Transport, info: SandboxInfo) -> None:
        self._t = transport
        self.info = info
        self.id = info.id
        self._path = f"/v1/sandboxes/{info.id}"

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.substrate}:{self.info.image} {self.info.state}>"

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # commands
    def _exec_body(self, command: str | list[str], env: dict[str, str] | None,
                   cwd: str | None, stdin: bytes | str | None, timeout_s: float | None,
                   max_output_bytes: int | None, session: str | None) -> dict[str, Any]:
        req = _validated(ExecRequest, command=command, env=env or {}, cwd=cwd, timeout_s=timeout_s,
                          session=session,
                          stdin_b64=None if stdin is None else
                          b64(stdin.encode() if isinstance(stdin, str) else stdin),
                          **({} if max_output_bytes is None else {"max_output_bytes": max_output_bytes}))
        return req.model_dump(exclude_unset=True)

    async def run(self, command: str | list[str], *, env: dict[str, str] | None = None,
                  cwd: str | None = None, stdin: bytes | str | None = None,
                  timeout_s: float | None = 60.0, max_output_bytes: int | None = None,
                  session: str | None = None) -> CommandResult:
        """Run a command to completion. A string runs under ``/bin/sh -c``; a list is an argv.
        Raises ``CommandTimeout`` (with ``.result`` holding partial output) on timeout."""
        body = self._exec_body(command, env, cwd, stdin, timeout_s, max_output_bytes, session)
        wire = ExecResult.model_validate(await self._t.json("POST", f"{self._path}/exec", json=body))
        result = CommandResult.from_wire(wire)
        if wire.timed_out:
            raise _timeout_error(result, timeout_s)
        return result

    def stream(self, command: str | list[str], *, env: dict[str, str] | None = None,
               cwd: str | None = None, stdin: bytes | str | None = None,
               timeout_s: float | None = 60.0, max_output_bytes: int | None = None,
               session: str | None = None) -> OutputStream:
        """Run a command and iterate over its output as it arrives."""
        body = self._exec_body(command, env, cwd, stdin, timeout_s, max_output_bytes, session)
        return OutputStream(self._t.ndjson("POST", f"{self._path}/exec/stream", json=body), timeout_s)

    async def start(self, command: str | list[str], *, env: dict[str, str] | None = None,
                    cwd: str | None = None, stdin: bytes | str | None = None,
                    timeout_s: float | None = None, max_output_bytes: int | None = None) -> Process:
        """Start a command in the background and return at once."""
        body = self._exec_body(command, env, cwd, stdin, timeout_s, max_output_bytes, None)
        info = await self._t.json("POST", f"{self._path}/processes", json=body)
        return Process(self, ProcessInfo.model_validate(info))

    async def processes(self) -> list[ProcessInfo]:
        return [ProcessInfo.model_validate(p)
                for p in await self._t.json("GET", f"{self._path}/processes")]

    def session(self, name: str) -> Session:
        return Session(self, name)

    # files
    async def read_file(self, path: str) -> bytes:
        return (await self._t.request("GET", f"{self._path}/files", params={"path": path})).content

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644,
                         append: bool = False) -> None:
        content = data.encode() if isinstance(data, str) else data
        await self._t.request("PUT", f"{self._path}/files", content=content,
                              params={"path": path, "mode": mode, "append": append})

    async def list_files(self, path: str = "/work") -> list[FileEntry]:
        return [FileEntry.model_validate(e)
                for e in await self._t.json("GET", f"{self._path}/dirs", params={"path": path})]

    async def stat(self, path: str) -> FileEntry:
        return FileEntry.model_validate(
            await self._t.json("GET", f"{self._path}/stat", params={"path": path}))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except FileNotFound:
            return False
        return True

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._t.request("DELETE", f"{self._path}/files",
                              params={"path": path, "recursive": recursive})

    async def mkdir(self, path: str, *, parents: bool = True) -> None:
        await self._t.request("POST", f"{self._path}/dirs", params={"path": path, "parents": parents})

    async def upload(self, local: str | Path, remote_dir: str) -> None:
        """Copy a local file or directory into ``remote_dir`` (created if missing) as one tar."""
        local = Path(local)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            if local.is_dir():
                for child in sorted(local.iterdir()):
                    tar.add(child, arcname=child.name)
            else:
                tar.add(local, arcname=local.name)
        await self.mkdir(remote_dir, parents=True)
        await self._t.request("PUT", f"{self._path}/archive", content=buf.getvalue(),
                              params={"path": remote_dir})

    async def download(self, remote_dir: str, local_dir: str | Path) -> None:
        """Copy the contents of ``remote_dir`` into ``local_dir``."""
        data = (await self._t.request("GET", f"{self._path}/archive",
                                      params={"path": remote_dir})).content
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(local_dir, filter="data")

    # lifecycle
    async def refresh(self) -> SandboxInfo:
        self.info = SandboxInfo.model_validate(await self._t.json("GET", self._path))
        return self.info

    async def set_ttl(self, ttl_s: int) -> SandboxInfo:
        self.info = SandboxInfo.model_validate(
            await self._t.json("PUT", f"{self._path}/ttl", json={"ttl_s": ttl_s}))
        return self.info

    async def stop(self) -> None:
        await self._t.request("DELETE", self._path)


class DSecClient:
    """The entry point. With no arguments it uses this host's local dsec server."""

    def __init__(self, url: str | None = None, api_key: str | None = None, *,
                 timeout_s: float = 600.0, autostart: bool = True) -> None:
        self._t = Transport(url, api_key, timeout_s, autostart)

    async def __aenter__(self) -> DSecClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._t.aclose()

    async def create(self, substrate: str = "container", image: str = "debian-minbase",
                     **options: Any) -> Sandbox:
        """Start a sandbox. Options: cpu, memory_mb, pids, ttl_s, network, env, runtime, labels."""
        req = _validated(CreateRequest, substrate=substrate, image=image, **options)
        info = await self._t.json("POST", "/v1/sandboxes", json=req.model_dump(exclude_unset=True))
        return Sandbox(self._t, SandboxInfo.model_validate(info))

    async def create_many(self, n: int, *, concurrency: int = 32,
                          **options: Any) -> list[Sandbox | DSecError]:
        """Start ``n`` sandboxes, at most ``concurrency`` at a time. Returns one entry per
        sandbox in order: the Sandbox, or the typed error that stopped it."""
        gate = asyncio.Semaphore(concurrency)

        async def one() -> Sandbox | DSecError:
            async with gate:
                try:
                    return await self.create(**options)
                except DSecError as exc:
                    return exc

        return list(await asyncio.gather(*(one() for _ in range(n))))

    async def get(self, sandbox_id: str) -> Sandbox:
        info = await self._t.json("GET", f"/v1/sandboxes/{sandbox_id}")
        return Sandbox(self._t, SandboxInfo.model_validate(info))

    async def list(self) -> list[SandboxInfo]:
        return [SandboxInfo.model_validate(s) for s in await self._t.json("GET", "/v1/sandboxes")]

    async def health(self) -> dict[str, Any]:
        return await self._t.json("GET", "/v1/health")
