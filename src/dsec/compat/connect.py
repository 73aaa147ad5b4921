"""The server side of the Connect protocol (https://connectrpc.com/docs/protocol/) over
HTTP/1.1: unary, server-streaming and client-streaming calls, each in the JSON or the binary
protobuf codec.

- Unary: ``POST /<package>.<Service>/<Method>`` with ``Content-Type: application/json`` (or
  ``application/proto``); the answer is the message, or an error as
  ``{"code": "not_found", "message": ...}`` with the code's HTTP status.
- Server streaming: ``Content-Type: application/connect+json`` (or ``+proto``); the request
  body and each answer message are *envelopes* (one flag byte, a 4-byte big-endian length,
  the message); the stream always ends with an end-of-stream envelope (flag ``0x02``) holding
  ``{}`` or ``{"error": {...}}``, under HTTP 200.
- Client streaming: the same content types; the request body is envelopes, read and handed
  to the handler one by one as they arrive; the answer is one envelope and the end of stream.
- ``Connect-Timeout-Ms`` bounds a call: handlers see it as ``Call.timeout_s``; a stream that
  outlives it ends with ``deadline_exceeded``.

A handler raises ``ConnectError`` for an RPC error, or ``PlainHttpError`` for an answer that
is not Connect at all (what a gateway in front of the service would answer, e.g. 502 for a
sandbox that does not exist); the latter is only possible before a stream's first message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..protocol.models import lone_surrogate
from .proto import DecodeError, Message, Schema

log = logging.getLogger("dsec.compat.connect")

HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403,
    "resource_exhausted": 429, "failed_precondition": 400, "aborted": 409, "out_of_range": 400,
    "unimplemented": 501, "internal": 500, "unavailable": 503, "data_loss": 500,
    "unauthenticated": 401,
}
_MAX_MESSAGE = 64 << 20


class ConnectError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class PlainHttpError(Exception):
    """A non-Connect answer: ``body`` as JSON with ``status``."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("message", ""))
        self.status = status
        self.body = body

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status)


@dataclass
class Call:
    """What a handler knows about the call besides its message."""

    request: Request
    timeout_s: float | None
    state: dict[str, Any] = field(default_factory=dict)  # filled by the service's ``prepare``

    @property
    def headers(self) -> Any:
        return self.request.headers


Unary = Callable[[Message, Call], Awaitable[Message]]
Stream = Callable[[Message, Call], AsyncIterator[Message]]
ClientStream = Callable[[AsyncIterator[Message], Call], Awaitable[Message]]


@dataclass(frozen=True)
class Method:
    input: str
    output: str
    unary: Unary | None = None
    stream: Stream | None = None
    client_stream: ClientStream | None = None


class Service:
    """The methods of one or more Connect services, served from one route."""

    def __init__(self, schema: Schema, methods: dict[str, Method],
                 prepare: Callable[[Call], Awaitable[None]] | None = None) -> None:
        self.schema = schema
        self.methods = methods  # "process.Process/Start" -> Method
        self.prepare = prepare

    async def handle(self, request: Request, name: str) -> Response:
        method = self.methods.get(name)
        if method is None:
            return _unary_error(ConnectError("unimplemented", f"{name} is not implemented by dsec"))
        content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        streaming = method.stream is not None or method.client_stream is not None
        prefix = "application/connect+" if streaming else "application/"
        codec = content_type[len(prefix):] if content_type.startswith(prefix) else ""
        if codec not in ("json", "proto"):
            return Response(f"unsupported content-type {content_type!r}; expected {prefix}json or "
                            f"{prefix}proto", status_code=415, media_type="text/plain",
                            headers={"Accept-Post": f"{prefix}json, {prefix}proto"})
        call = Call(request, None)
        if method.client_stream is not None:
            return await self._serve_client_stream(method, method.client_stream, call, codec)
        try:
            call.timeout_s = _timeout(request)
            body = await request.body()
            if streaming:
                body = _first_envelope(body, request.headers.get("connect-content-encoding"))
            elif request.headers.get("content-encoding", "identity").lower() == "gzip":
                body = _gunzip(body)
            message = self._decode(method.input, codec, body)
            if self.prepare is not None:
                await self.prepare(call)
        except PlainHttpError as exc:
            return exc.response()
        except ConnectError as exc:
            return self._stream_error(exc, codec) if streaming else _unary_error(exc)
        except (zlib.error, ValueError) as exc:  # bad gzip, bad envelope
            err = ConnectError("invalid_argument", f"malformed request: {exc}")
            return self._stream_error(err, codec) if streaming else _unary_error(err)
        if streaming:
            assert method.stream is not None
            return await self._serve_stream(method, method.stream(message, call), call, codec)
        assert method.unary is not None
        try:
            answer = await method.unary(message, call)
        except PlainHttpError as exc:
            return exc.response()
        except ConnectError as exc:
            return _unary_error(exc)
        except Exception as exc:  # a bug: still a proper Connect error
            log.exception("call %s failed", name)
            return _unary_error(ConnectError("internal", f"internal error: {exc!r}"))
        return Response(self._encode(method.output, codec, answer), media_type=f"application/{codec}")

    def _decode(self, name: str, codec: str, body: bytes) -> Message:
        try:
            if codec == "json":
                data = json.loads(body or b"{}")
                if lone_surrogate(data) is not None:
                    raise ValueError("a string holds a lone surrogate, which is not text")
                return self.schema.from_json(name, data)
            return self.schema.decode(name, body)
        except (DecodeError, ValueError) as exc:
            raise ConnectError("invalid_argument", f"cannot decode {name}: {exc}") from None

    def _encode(self, name: str, codec: str, message: Message) -> bytes:
        if codec == "json":
            return json.dumps(self.schema.to_json(name, message), separators=(",", ":")).encode()
        return self.schema.encode(name, message)

    async def _serve_client_stream(self, method: Method, handler: ClientStream, call: Call,
                                   codec: str) -> Response:
        """The handler reads the request's messages as they arrive (bounded by the call's
        timeout); its one answer, or its error, ends the stream."""
        encoding = call.request.headers.get("connect-content-encoding")

        async def messages() -> AsyncIterator[Message]:
            async for data in _request_envelopes(call.request, encoding):
                yield self._decode(method.input, codec, data)

        try:
            call.timeout_s = _timeout(call.request)
            if self.prepare is not None:
                await self.prepare(call)
            async with asyncio.timeout(call.timeout_s):
                answer = await handler(messages(), call)
        except PlainHttpError as exc:
            return exc.response()
        except ConnectError as exc:
            return self._stream_error(exc, codec)
        except TimeoutError:
            return self._stream_error(ConnectError(
                "deadline_exceeded", f"the call's timeout of {call.timeout_s}s "
                "(Connect-Timeout-Ms) expired"), codec)
        except (zlib.error, ValueError) as exc:  # bad gzip
            return self._stream_error(ConnectError("invalid_argument",
                                                   f"malformed request: {exc}"), codec)
        except Exception as exc:  # a bug: still a proper Connect error
            log.exception("client stream %s failed", method.input)
            return self._stream_error(ConnectError("internal", f"internal error: {exc!r}"), codec)
        return Response(_envelope(0, self._encode(method.output, codec, answer)) + _end_stream(None),
                        media_type=f"application/connect+{codec}")

    def _stream_error(self, exc: ConnectError, codec: str) -> Response:
        return Response(_end_stream(exc), media_type=f"application/connect+{codec}")

    async def _serve_stream(self, method: Method, events: AsyncIterator[Message], call: Call,
                            codec: str) -> Response:
        """Wait for the first event before answering, so that an error found before the stream
        starts (no such sandbox) can still be a plain HTTP error."""
        iterator = _deadline(events, call.timeout_s)
        try:
            first: Message | None = await anext(iterator)
        except StopAsyncIteration:
            first = None
        except PlainHttpError as exc:
            await iterator.aclose()
            return exc.response()
        except ConnectError as exc:
            await iterator.aclose()
            return self._stream_error(exc, codec)
        except Exception as exc:  # a bug: still a proper Connect error
            log.exception("stream %s failed", method.output)
            await iterator.aclose()
            return self._stream_error(ConnectError("internal", f"internal error: {exc!r}"), codec)

        async def envelopes() -> AsyncIterator[bytes]:
            error: ConnectError | None = None
            try:
                if first is not None:
                    yield _envelope(0, self._encode(method.output, codec, first))
                    async for event in iterator:
                        yield _envelope(0, self._encode(method.output, codec, event))
            except ConnectError as exc:
                error = exc
            except PlainHttpError as exc:
                error = ConnectError("unavailable", exc.body.get("message", str(exc)))
            except Exception as exc:  # a bug: still end the stream properly
                log.exception("stream %s failed", method.output)
                error = ConnectError("internal", f"internal error: {exc!r}")
            finally:
                await iterator.aclose()
            yield _end_stream(error)

        return StreamingResponse(envelopes(), media_type=f"application/connect+{codec}")


async def _deadline(events: AsyncIterator[Message], timeout_s: float | None) -> AsyncGenerator[Message, None]:
    """``events``, ended by ``deadline_exceeded`` once ``timeout_s`` has passed."""
    iterator = aiter(events)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s if timeout_s else None
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    event = await anext(iterator)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise ConnectError("deadline_exceeded", f"the call's timeout of {timeout_s}s "
                                   "(Connect-Timeout-Ms) expired") from None
            yield event
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


def _timeout(request: Request) -> float | None:
    raw = request.headers.get("connect-timeout-ms")
    if not raw:
        return None
    try:
        ms = int(raw)
    except ValueError:
        raise ConnectError("invalid_argument", f"invalid Connect-Timeout-Ms {raw!r}") from None
    return ms / 1000 if ms > 0 else None


def _first_envelope(body: bytes, encoding: str | None) -> bytes:
    if len(body) < 5:
        raise ConnectError("invalid_argument", "the request is not an enveloped message")
    flags, size = struct.unpack(">BI", body[:5])
    if size > _MAX_MESSAGE or len(body) < 5 + size:
        raise ConnectError("invalid_argument", "truncated request envelope")
    return _payload(flags, body[5:5 + size], encoding)


async def _request_envelopes(request: Request, encoding: str | None) -> AsyncIterator[bytes]:
    """The messages of a streamed request body, each as soon as its envelope is whole."""
    pending = bytearray()
    async for chunk in request.stream():
        pending += chunk
        while len(pending) >= 5:
            flags, size = struct.unpack(">BI", pending[:5])
            if size > _MAX_MESSAGE:
                raise ConnectError("resource_exhausted", f"a request message over {_MAX_MESSAGE} bytes")
            if len(pending) < 5 + size:
                break
            data = bytes(pending[5:5 + size])
            del pending[:5 + size]
            yield _payload(flags, data, encoding)
    if pending:
        raise ConnectError("invalid_argument", "truncated request envelope")


def _payload(flags: int, data: bytes, encoding: str | None) -> bytes:
    if flags & 1:
        if (encoding or "identity").lower() != "gzip":
            raise ConnectError("internal", f"compressed envelope with encoding {encoding!r}")
        data = _gunzip(data)
    return data


def _gunzip(data: bytes) -> bytes:
    """A gzip body, refused once it unpacks past the message cap: a few KiB of a client's
    gzip can otherwise unpack to gigabytes in the server's memory."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    out = inflater.decompress(data, _MAX_MESSAGE + 1)
    if len(out) > _MAX_MESSAGE:
        raise ConnectError("resource_exhausted", f"a request message unpacking to over {_MAX_MESSAGE} bytes")
    if not inflater.eof:
        raise ConnectError("invalid_argument", "truncated gzip data")
    return out


def _envelope(flags: int, data: bytes) -> bytes:
    return struct.pack(">BI", flags, len(data)) + data


def _end_stream(error: ConnectError | None) -> bytes:
    body = {"error": error.to_json()} if error is not None else {}
    return _envelope(2, json.dumps(body).encode())


def _unary_error(exc: ConnectError) -> JSONResponse:
    return JSONResponse(exc.to_json(), status_code=HTTP_STATUS.get(exc.code, 500))
