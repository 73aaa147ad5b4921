"""The Connect protocol layer of the E2B front-end (dsec.compat.connect), in process: unary and
server-streaming calls in both codecs, envelopes, end-of-stream, errors, gzip and timeouts, as
https://connectrpc.com/docs/protocol/ states them. Envelopes are built and split by hand here:
one flag byte, a 4-byte big-endian length, the message; flag 0x01 compressed, 0x02 end of stream.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dsec.compat.connect import Call, ConnectError, Method, PlainHttpError, Service
from dsec.compat.proto import ENVD, Message

STAT = "/filesystem.Filesystem/Stat"
START = "/process.Process/Start"


async def stat(message: Message, call: Call) -> Message:
    if message.get("path") == "/missing":
        raise ConnectError("not_found", "no such file")
    if message.get("path") == "/gateway":
        raise PlainHttpError(502, {"message": "sandbox not found"})
    if message.get("path") == "/bug":
        raise RuntimeError("a bug")
    return {"entry": {"name": "a", "path": message["path"], "size": 3}}


async def start(message: Message, call: Call) -> AsyncIterator[Message]:
    cmd = message["process"]["cmd"]
    if cmd == "no-sandbox":
        raise ConnectError("not_found", "no such sandbox")
    yield {"event": {"start": {"pid": 7}}}
    if cmd == "slow":
        await asyncio.sleep(30)
    yield {"event": {"data": {"stdout": b"hi\n"}}}
    if cmd == "fail":
        raise ConnectError("aborted", "went away")
    yield {"event": {"end": {"exit_code": 0, "exited": True}}}


def endpoint(service: Service):  # type: ignore[no-untyped-def]
    async def handle(request: Request) -> Response:
        return await service.handle(request, request.path_params["name"])
    return handle


@pytest.fixture(scope="module")
async def http() -> AsyncIterator[httpx.AsyncClient]:
    service = Service(ENVD, {"filesystem.Filesystem/Stat": Method("filesystem.StatRequest", "filesystem.StatResponse",
                                                                  unary=stat),
                             "process.Process/Start": Method("process.StartRequest", "process.StartResponse",
                                                             stream=start)})
    app = Starlette(routes=[Route("/{name:path}", endpoint(service), methods=["POST"])])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://envd") as client:
        yield client


def envelope(flags: int, data: bytes) -> bytes:
    return bytes([flags]) + len(data).to_bytes(4, "big") + data


def envelopes(body: bytes) -> list[tuple[int, bytes]]:
    out, pos = [], 0
    while pos < len(body):
        size = int.from_bytes(body[pos + 1:pos + 5], "big")
        out.append((body[pos], body[pos + 5:pos + 5 + size]))
        pos += 5 + size
    assert pos == len(body)
    return out


async def stream_json(http: httpx.AsyncClient, message: dict[str, Any], **headers: str) -> tuple[list[Any], dict[str, Any]]:
    """(messages, end-of-stream body) of a JSON streaming call."""
    answer = await http.post(START, content=envelope(0, json.dumps(message).encode()),
                       headers={"content-type": "application/connect+json", **headers})
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/connect+json"
    *messages, (end_flags, end) = envelopes(answer.content)
    assert end_flags == 2 and all(flags == 0 for flags, _ in messages)
    return [json.loads(data) for _, data in messages], json.loads(end)


async def test_unary_json(http: httpx.AsyncClient) -> None:
    answer = await http.post(STAT, json={"path": "/work/a"})
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    assert answer.json() == {"entry": {"name": "a", "path": "/work/a", "size": "3"}}  # int64 as a string


async def test_unary_proto(http: httpx.AsyncClient) -> None:
    # StatRequest{path: "/a"}: field 1, wire type 2 (key 0x0a), length 2
    answer = await http.post(STAT, content=b"\x0a\x02/a", headers={"content-type": "application/proto"})
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/proto"
    assert ENVD.decode("filesystem.StatResponse", answer.content) == {"entry": {"name": "a", "path": "/a", "size": 3}}


async def test_unary_gzip(http: httpx.AsyncClient) -> None:
    answer = await http.post(STAT, content=gzip.compress(b'{"path": "/z"}'),
                       headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert answer.status_code == 200 and answer.json()["entry"]["path"] == "/z"


@pytest.mark.parametrize(("path", "status", "code"), [
    ("/missing", 404, "not_found"),
    ("/bug", 500, "internal"),
])
async def test_unary_errors_carry_their_code_and_status(http: httpx.AsyncClient, path: str, status: int, code: str) -> None:
    answer = await http.post(STAT, json={"path": path})
    assert answer.status_code == status
    assert answer.json()["code"] == code and answer.json()["message"]


async def test_a_plain_http_error_is_not_connect(http: httpx.AsyncClient) -> None:
    answer = await http.post(STAT, json={"path": "/gateway"})
    assert answer.status_code == 502 and answer.json() == {"message": "sandbox not found"}


@pytest.mark.parametrize(("body", "content_type"), [
    (b"{not json", "application/json"),
    (b'{"path": 5}', "application/json"),
    (b'{"path": "\\ud800"}', "application/json"),  # a lone surrogate is not text
    (b"\x0a\x05/a", "application/proto"),  # length beyond the body
])
async def test_a_malformed_request_is_invalid_argument(http: httpx.AsyncClient, body: bytes, content_type: str) -> None:
    answer = await http.post(STAT, content=body, headers={"content-type": content_type})
    assert answer.status_code == 400 and answer.json()["code"] == "invalid_argument"


async def test_an_unknown_method_is_unimplemented(http: httpx.AsyncClient) -> None:
    answer = await http.post("/filesystem.Filesystem/WatchDir", json={})
    assert answer.status_code == 501 and answer.json()["code"] == "unimplemented"


async def test_an_unsupported_content_type_is_415_with_what_is_accepted(http: httpx.AsyncClient) -> None:
    answer = await http.post(STAT, content=b"path=/a", headers={"content-type": "text/plain"})
    assert answer.status_code == 415
    assert answer.headers["accept-post"] == "application/json, application/proto"
    # a unary content type on a streaming method is refused too
    answer = await http.post(START, json={})
    assert answer.status_code == 415
    assert answer.headers["accept-post"] == "application/connect+json, application/connect+proto"


async def test_a_stream_is_envelopes_ended_by_an_end_of_stream(http: httpx.AsyncClient) -> None:
    messages, end = await stream_json(http, {"process": {"cmd": "echo"}})
    assert messages == [{"event": {"start": {"pid": 7}}}, {"event": {"data": {"stdout": "aGkK"}}},
                        {"event": {"end": {"exited": True}}}]
    assert end == {}


async def test_a_stream_in_proto(http: httpx.AsyncClient) -> None:
    # StartRequest{process: {cmd: "echo"}}: field 1 (0x0a) holding field 1 (0x0a) "echo"
    answer = await http.post(START, content=envelope(0, b"\x0a\x06\x0a\x04echo"),
                       headers={"content-type": "application/connect+proto"})
    assert answer.status_code == 200
    *messages, (end_flags, end) = envelopes(answer.content)
    assert [ENVD.decode("process.StartResponse", data) for _, data in messages][0] == {"event": {"start": {"pid": 7}}}
    assert len(messages) == 3 and end_flags == 2 and json.loads(end) == {}


async def test_a_compressed_envelope(http: httpx.AsyncClient) -> None:
    body = envelope(1, gzip.compress(b'{"process": {"cmd": "echo"}}'))
    answer = await http.post(START, content=body, headers={"content-type": "application/connect+json",
                                                      "connect-content-encoding": "gzip"})
    assert len(envelopes(answer.content)) == 4
    answer = await http.post(START, content=body, headers={"content-type": "application/connect+json"})
    (flags, end), = envelopes(answer.content)
    assert flags == 2 and json.loads(end)["error"]["code"] == "internal"


BOMB = gzip.compress(b"{" + b" " * (65 << 20) + b"}")  # 65 MiB of JSON in about 64 KiB


async def test_a_gzip_bomb_is_refused_before_it_unpacks(http: httpx.AsyncClient) -> None:
    assert len(BOMB) < 1 << 17
    answer = await http.post(STAT, content=BOMB, headers={"content-type": "application/json",
                                                          "content-encoding": "gzip"})
    assert answer.status_code == 429 and answer.json()["code"] == "resource_exhausted"
    answer = await http.post(START, content=envelope(1, BOMB), headers={
        "content-type": "application/connect+json", "connect-content-encoding": "gzip"})
    (flags, end), = envelopes(answer.content)
    assert flags == 2 and json.loads(end)["error"]["code"] == "resource_exhausted"


@pytest.mark.parametrize("body", [gzip.compress(b'{"path": "/z"}')[:-12], b"\x1f\x8b\x08garbage"])
async def test_truncated_or_bad_gzip_is_invalid_argument(http: httpx.AsyncClient, body: bytes) -> None:
    answer = await http.post(STAT, content=body, headers={"content-type": "application/json",
                                                          "content-encoding": "gzip"})
    assert answer.status_code == 400 and answer.json()["code"] == "invalid_argument"


async def test_errors_in_a_stream_end_it_under_http_200(http: httpx.AsyncClient) -> None:
    messages, end = await stream_json(http, {"process": {"cmd": "fail"}})
    assert len(messages) == 2 and end == {"error": {"code": "aborted", "message": "went away"}}
    messages, end = await stream_json(http, {"process": {"cmd": "no-sandbox"}})
    assert messages == [] and end["error"]["code"] == "not_found"


@pytest.mark.parametrize("body", [b"", b"\x00\x00\x00", b"\x00\x00\x00\x00\x09{}"])
async def test_a_bad_request_envelope_is_invalid_argument(http: httpx.AsyncClient, body: bytes) -> None:
    answer = await http.post(START, content=body, headers={"content-type": "application/connect+json"})
    assert answer.status_code == 200
    (flags, end), = envelopes(answer.content)
    assert flags == 2 and json.loads(end)["error"]["code"] == "invalid_argument"


async def test_the_timeout_header_ends_a_stream_with_deadline_exceeded(http: httpx.AsyncClient) -> None:
    messages, end = await stream_json(http, {"process": {"cmd": "slow"}}, **{"connect-timeout-ms": "300"})
    assert messages == [{"event": {"start": {"pid": 7}}}]
    assert end["error"]["code"] == "deadline_exceeded"
    messages, end = await stream_json(http, {"process": {"cmd": "echo"}}, **{"connect-timeout-ms": "soon"})
    assert messages == [] and end["error"]["code"] == "invalid_argument"
