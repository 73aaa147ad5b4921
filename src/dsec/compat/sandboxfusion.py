"""SandboxFusion compatibility: ``POST /run_code`` and ``GET /v1/ping``.

SandboxFusion (bytedance/SandboxFusion) runs one snippet per call: restore the request's
files into a fresh directory, write the code next to them, compile it if the language needs
that, run it with ``stdin`` and a time limit, and fetch files back. Here each call gets a
short-lived sandbox of its own (the ``fn`` substrate when the server has one, a container
otherwise; the warm pool makes the create a claim), which is stopped when the call ends.

Request and response follow ``sandbox/server/sandbox_api.py``: ``RunCodeRequest``
(``code``, ``language``, ``stdin``, ``compile_timeout``, ``run_timeout``,
``memory_limit_MB``, ``files``, ``fetch_files``) and ``RunCodeResponse`` (``status``:
``Success``, ``Failed`` or ``SandboxError``; ``compile_result``/``run_result`` with
``status`` ``Finished``/``TimeLimitExceeded``/``Error``, ``return_code``, ``stdout``,
``stderr``, ``execution_time``).

A language whose tool chain the image lacks (C++ needs ``g++``, which dsec's images do not
have) answers ``SandboxError`` with a message saying so, never ``Failed``: a reward function
must not score a missing compiler as a wrong answer.

Authentication: any dsec API key, as ``Authorization: Bearer KEY`` or HTTP Basic auth with
the key as the password; the clients take the latter from the endpoint URL
(``http://dsec:KEY@host:port/sandboxfusion``).
"""

from __future__ import annotations

import base64
import binascii
import logging
import posixpath
import secrets
from dataclasses import dataclass
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field, ValidationError

from ..agent.tools import SHELL
from ..control.routing import Router
from ..edge.edge import Edge
from ..protocol.errors import DSecError
from ..protocol.models import CreateRequest, ExecRequest, ExecResult, _Request, b64
from .auth import Keys

log = logging.getLogger("dsec.compat.sandboxfusion")

WORKDIR = "/work"
DEFAULT_IMAGE = "python-3.11"
DEFAULT_MEMORY_MB = 1024
MAX_OUTPUT = 8 << 20  # per stream


@dataclass(frozen=True)
class Language:
    suffix: str
    run: str  # shell command; {file} is the code file
    compile: str | None = None
    requires: str = ""  # a shell test that must pass in the image, and what it needs
    needs: str = ""


# SandboxFusion's commands (sandbox/runners/major.py), for the languages dsec's images can have.
LANGUAGES = {
    "python": Language(".py", "python3 {file}", requires="command -v python3", needs="python3"),
    "pytest": Language(".py", "python3 -m pytest {file}", requires="python3 -c 'import pytest'",
                       needs="python3 with pytest"),
    "bash": Language(".sh", "bash {file}", requires="command -v bash", needs="bash"),
    "cpp": Language(".cpp", "./test", compile="g++ -std=c++17 {file} -o test -lpthread",
                    requires="command -v g++", needs="g++"),
    "nodejs": Language(".js", "node {file}", requires="command -v node", needs="node"),
    "go": Language(".go", "./out", compile="go build -o out {file}", requires="command -v go",
                   needs="go"),
}


class RunCodeRequest(_Request):
    model_config = ConfigDict(extra="ignore")  # finite numbers and text only, as every request

    code: str
    language: str
    compile_timeout: float = Field(10, gt=0)
    run_timeout: float = Field(10, gt=0)
    memory_limit_MB: int = -1
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


def _result(status: str, result: ExecResult | None = None, error: str | None = None) -> dict[str, Any]:
    if result is None:
        return {"status": status, "execution_time": None, "return_code": None, "stdout": None,
                "stderr": error}
    return {"status": status, "execution_time": result.duration_ms / 1000,
            "return_code": None if status == "TimeLimitExceeded" else result.exit_code,
            "stdout": result.stdout_bytes.decode(errors="replace"),
            "stderr": result.stderr_bytes.decode(errors="replace")}


def _response(status: str, message: str = "", compile_result: dict[str, Any] | None = None,
              run_result: dict[str, Any] | None = None, files: dict[str, str] | None = None,
              executor: str | None = None) -> JSONResponse:
    return JSONResponse({"status": status, "message": message, "compile_result": compile_result,
                         "run_result": run_result, "executor_pod_name": executor, "files": files or {}})


class SandboxError(Exception):
    """Not the code's fault: answered as ``status: SandboxError``."""


class SandboxFusion:
    def __init__(self, router: Router, keys: Keys, image: str) -> None:
        self.router = router
        self.keys = keys
        self.image = image
        self._available: dict[tuple[str, str], bool] = {}  # (image digest, language) -> tool chain there

    def substrate(self) -> str:
        """The ``fn`` substrate when an edge serves it (function-style calls are what it is
        for), containers until then."""
        return "fn" if "fn" in self.router.directory.substrates() else "container"

    async def run_code(self, request: Request) -> JSONResponse:
        if not self.keys.valid(self.keys.from_headers(request.headers)):
            return JSONResponse({"detail": "a dsec API key is required: put it in the endpoint URL "
                                 "(http://dsec:KEY@host:port/sandboxfusion) or send "
                                 "Authorization: Bearer KEY"}, status_code=401)
        try:
            req = RunCodeRequest.model_validate(await request.json())
        except ValueError as exc:
            errors = (exc.errors(include_url=False, include_input=False, include_context=False)
                      if isinstance(exc, ValidationError) else str(exc))
            return JSONResponse({"detail": errors}, status_code=422)
        language = LANGUAGES.get(req.language)
        if language is None:
            return _response("SandboxError", f"language {req.language!r} is not supported by dsec "
                             f"(supported: {', '.join(sorted(LANGUAGES))})")
        try:
            return await self._run(req, language)
        except SandboxError as exc:
            return _response("SandboxError", str(exc))
        except DSecError as exc:
            return _response("SandboxError", f"dsec {exc.code}: {exc.message}")

    async def _run(self, req: RunCodeRequest, language: Language) -> JSONResponse:
        memory_mb = max(64, req.memory_limit_MB) if req.memory_limit_MB > 0 else DEFAULT_MEMORY_MB
        ttl = int(req.compile_timeout + req.run_timeout) + 120  # the reaper's backstop
        info = await self.router.create(CreateRequest(
            substrate=self.substrate(), image=self.image, cpu=1, memory_mb=memory_mb, ttl_s=ttl,
            labels={"dsec.compat": "sandboxfusion"}))
        edge = cast(Edge, self.router.edge_for(info.id))  # or its trajectory recorder: same methods
        try:
            key = (info.image_digest, req.language)
            if key not in self._available:
                check = await edge.run(info.id, ExecRequest(command=[SHELL, "-c", language.requires],
                                                            timeout_s=30))
                self._available[key] = check.exit_code == 0
            if not self._available[key]:
                raise SandboxError(f"language {req.language!r} needs {language.needs}, which the "
                                   f"sandbox image {self.image!r} does not have")
            for name, content in req.files.items():
                if content is None or "IGNORE_THIS_FILE" in name:
                    continue
                try:
                    data = base64.b64decode(content, validate=True)
                except (binascii.Error, ValueError):
                    raise SandboxError(f"files[{name!r}] is not valid base64") from None
                await self._write(edge, info.id, name, data)
            code_file = f"tmp{secrets.token_hex(4)}{language.suffix}"
            await edge.write_file(info.id, posixpath.join(WORKDIR, code_file), req.code.encode())

            compile_result = None
            if language.compile is not None:
                compiled = await self._exec(edge, info.id, language.compile.format(file=code_file),
                                            req.compile_timeout, None)
                compile_result = _result("TimeLimitExceeded" if compiled.timed_out else "Finished", compiled)
                if compiled.timed_out or compiled.exit_code != 0:
                    return _response("Failed", compile_result=compile_result,
                                     files=await self._fetch(edge, info.id, req.fetch_files),
                                     executor=info.id)
            ran = await self._exec(edge, info.id, language.run.format(file=code_file),
                                   req.run_timeout, req.stdin)
            run_result = _result("TimeLimitExceeded" if ran.timed_out else "Finished", ran)
            ok = not ran.timed_out and ran.exit_code == 0
            return _response("Success" if ok else "Failed", compile_result=compile_result,
                             run_result=run_result,
                             files=await self._fetch(edge, info.id, req.fetch_files), executor=info.id)
        finally:
            try:
                await edge.stop(info.id, "stopped", "SandboxFusion call done")
            except DSecError:
                log.warning("could not stop %s", info.id, exc_info=True)

    @staticmethod
    async def _exec(edge: Edge, sandbox_id: str, command: str, timeout_s: float,
                    stdin: str | None) -> ExecResult:
        return await edge.run(sandbox_id, ExecRequest(
            command=[SHELL, "-c", command], cwd=WORKDIR, timeout_s=timeout_s,
            stdin_b64=b64(stdin.encode()) if stdin is not None else None, max_output_bytes=MAX_OUTPUT))

    @staticmethod
    async def _write(edge: Edge, sandbox_id: str, name: str, data: bytes) -> None:
        path = posixpath.normpath(posixpath.join(WORKDIR, name))
        try:
            await edge.mkdir(sandbox_id, posixpath.dirname(path), parents=True)
            await edge.write_file(sandbox_id, path, data)
        except DSecError as exc:
            raise SandboxError(f"cannot write files[{name!r}]: {exc.message}") from None

    @staticmethod
    async def _fetch(edge: Edge, sandbox_id: str, names: list[str]) -> dict[str, str]:
        files = {}
        for name in names:
            path = posixpath.normpath(posixpath.join(WORKDIR, name))
            try:
                entry = await edge.stat(sandbox_id, path)
                if entry.type != "file":
                    continue
                files[name] = b64(await edge.read_file(sandbox_id, path))
            except DSecError:
                continue  # like SandboxFusion: a file that is not there is left out
        return files


def create_sandboxfusion_app(router: Router, keys: Keys, image: str) -> FastAPI:
    """``image``: the one ``run_code`` runs in."""
    sf = SandboxFusion(router, keys, image)
    app = FastAPI(title="dsec: SandboxFusion compatibility", docs_url=None, redoc_url=None)
    app.add_api_route("/run_code", sf.run_code, methods=["POST"])

    @app.get("/v1/ping")
    async def ping() -> str:
        return "pong"

    return app
