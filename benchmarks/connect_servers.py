"""The two envd servers ``dsec bench --only connect`` compares, each serving the same two
handlers (a unary ``Filesystem/Stat`` and a ``Process/Start`` stream of 100 output chunks of
4 KiB) on a Unix socket: ``dsec``, dsec's own Connect server and protobuf codec
(``dsec.compat.connect``, ``dsec.compat.proto``), run in dsec's interpreter; ``connectrpc``,
the ``connectrpc`` library's ASGI server with the envd messages and service stubs the e2b SDK
generates from envd's ``.proto`` files with ``protobuf-py``, run in a virtualenv holding that
SDK (``bench_connect`` builds it). Both behind the same uvicorn. A separate script because the
two sides cannot share one interpreter: connectrpc needs Python >= 3.11 and packages that dsec
does not install.

``python connect_servers.py dsec|connectrpc SOCKET``
"""

from __future__ import annotations

import sys
from typing import Any

CHUNK = bytes(range(256)) * 16
EVENTS = 100


def dsec_app() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.routing import Route

    from dsec.compat.connect import Call, Method, Service
    from dsec.compat.proto import ENVD, Message

    async def stat(message: Message, call: Call) -> Message:
        return {"entry": {"name": "f.txt", "type": 1, "path": message["path"], "size": 1234,
                          "mode": 0o644, "permissions": "-rw-r--r--", "owner": "user", "group": "user"}}

    async def start(message: Message, call: Call) -> Any:
        yield {"event": {"start": {"pid": 7}}}
        for _ in range(EVENTS):
            yield {"event": {"data": {"stdout": CHUNK}}}
        yield {"event": {"end": {"exit_code": 0, "exited": True, "status": "exit status 0"}}}

    service = Service(ENVD, {
        "filesystem.Filesystem/Stat": Method("filesystem.StatRequest", "filesystem.StatResponse", unary=stat),
        "process.Process/Start": Method("process.StartRequest", "process.StartResponse", stream=start)})

    async def handle(request: Request) -> Any:
        return await service.handle(request, request.path_params["name"])
    return Starlette(routes=[Route("/{name:path}", handle, methods=["POST"])])


def connectrpc_app() -> Any:
    from e2b.envd.filesystem import filesystem_pb as fs  # type: ignore[import-not-found]
    from e2b.envd.filesystem.filesystem_connect import (  # type: ignore[import-not-found]
        FilesystemASGIApplication,
    )
    from e2b.envd.process import process_pb as pr  # type: ignore[import-not-found]
    from e2b.envd.process.process_connect import ProcessASGIApplication  # type: ignore[import-not-found]
    from protobuf import Oneof  # type: ignore[import-not-found]

    class Unimplemented:
        def __getattr__(self, name: str) -> Any:
            async def missing(request: Any, ctx: Any) -> Any:
                raise NotImplementedError(name)
            return missing

    class Filesystem(Unimplemented):
        async def stat(self, request: Any, ctx: Any) -> Any:
            return fs.StatResponse(entry=fs.EntryInfo(
                name="f.txt", type=fs.FileType.FILE, path=request.path, size=1234, mode=0o644,
                permissions="-rw-r--r--", owner="user", group="user"))

    class Process(Unimplemented):
        async def start(self, request: Any, ctx: Any) -> Any:
            event = pr.ProcessEvent
            yield pr.StartResponse(event=event(event=Oneof("start", event.StartEvent(pid=7))))
            for _ in range(EVENTS):
                data = event.DataEvent(output=Oneof("stdout", CHUNK))
                yield pr.StartResponse(event=event(event=Oneof("data", data)))
            end = event.EndEvent(exit_code=0, exited=True, status="exit status 0")
            yield pr.StartResponse(event=event(event=Oneof("end", end)))

    filesystem, process = FilesystemASGIApplication(Filesystem()), ProcessASGIApplication(Process())

    async def app(scope: Any, receive: Any, send: Any) -> None:
        served = process if scope.get("path", "").startswith("/process.") else filesystem
        await served(scope, receive, send)
    return app


if __name__ == "__main__":
    import uvicorn

    side, socket = sys.argv[1], sys.argv[2]
    uvicorn.run(dsec_app() if side == "dsec" else connectrpc_app(), uds=socket, log_level="warning",
                loop="uvloop", http="httptools")
