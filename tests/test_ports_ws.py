"""WebSocket through sandbox ports (docs/API.md "Sandbox ports", control/port_ws.py): a
WebSocket server inside a real sandbox (tests/support/port_server.py's ``/ws`` pages, hand-made
on the standard library) reached by the ``websockets`` package through the port token, the
key route and E2B's ``get_host`` form; and what a hostile server or caller cannot do with it.

The server fixtures are test_ports.py's (containers under crun and runsc, ``DSEC_PORT_IDLE_S``
of a few seconds).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

import dsec
from conftest import Server
from test_ports import PORT, auth, client, sb, serving, srv, tampered  # noqa: F401 (fixtures)


def ws_url(http_url: str) -> str:
    return "ws" + http_url.removeprefix("http")


def dial(url: str, **options: Any) -> Any:
    """A ``websockets`` client of the proxy: no proxy from the environment, any size."""
    return connect(url, proxy=None, open_timeout=120, max_size=None, **options)


async def echoes(ws: ClientConnection) -> None:
    await ws.send("hello")
    assert await ws.recv() == "hello"
    payload = bytes(range(256)) * 1000
    await ws.send(payload)
    assert await ws.recv() == payload


def refusal(exc: pytest.ExceptionInfo[InvalidStatus]) -> tuple[int, Any]:
    response = exc.value.response
    return response.status_code, response


async def test_a_websocket_reaches_the_port_by_token_key_and_e2b_host(
        sb: dsec.AsyncSandbox, srv: Server) -> None:
    url = await sb.url(PORT)
    async with dial(ws_url(url) + "ws", subprotocols=["one", "two"]) as ws:  # no key: the token
        assert ws.subprotocol == "two"  # the sandbox's server picked it
        await echoes(ws)
    async with dial(f"{ws_url(srv.url)}/v1/sandboxes/{sb.id}/ports/{PORT}/ws",
                    additional_headers=auth(srv)) as ws:
        assert ws.subprotocol is None
        await echoes(ws)
    host, port = srv.url.removeprefix("http://").split(":")
    # E2B: get_host(port) is "{port}-{sandbox id}.{domain}"; the server is named by Host
    async with dial(f"ws://{PORT}-{sb.id}.e2b.test/e2b/ws", host=host, port=int(port),
                    additional_headers={"X-API-Key": srv.key}) as ws:
        await echoes(ws)
    # and by E2B's routing headers (E2B_SANDBOX_URL pointing at the server)
    async with dial(f"{ws_url(srv.url)}/e2b/ws", additional_headers={
            "X-API-Key": srv.key, "E2b-Sandbox-Id": sb.id, "E2b-Sandbox-Port": str(PORT)}) as ws:
        await echoes(ws)


async def test_the_handshake_carries_no_credentials(sb: dsec.AsyncSandbox, srv: Server) -> None:
    sent = {"Authorization": f"Bearer {srv.key}", "X-API-Key": srv.key, "Cookie": f"k={srv.key}",
            "X-DSec-Step": "1", "X-Access-Token": "tok", "X-Mine": "kept"}
    async with dial(f"{ws_url(srv.url)}/v1/sandboxes/{sb.id}/ports/{PORT}/ws",
                    additional_headers=sent) as ws:
        await ws.send("headers")
        got = {k.lower(): v for k, v in json.loads(await ws.recv())}
    assert got["x-mine"] == "kept" and got["host"] == f"localhost:{PORT}"
    assert not {"authorization", "x-api-key", "cookie", "x-dsec-step", "x-access-token"} & set(got)
    assert srv.key not in json.dumps(got)
    url = await sb.url(PORT)
    token = url.rstrip("/").rsplit("/", 1)[1]
    async with dial(ws_url(url) + "ws") as ws:
        await ws.send("headers")
        got = {k.lower(): v for k, v in json.loads(await ws.recv())}
    assert token not in json.dumps({k: v for k, v in got.items() if k != "path"})


async def test_a_token_or_a_key_opens_only_its_own_websocket(
        client: dsec.DSecClient, sb: dsec.AsyncSandbox, srv: Server) -> None:
    other = await serving(client, srv)
    try:
        base, token = (await sb.url(PORT)).rstrip("/").rsplit("/", 1)
        sandbox_id, port, mac = token.split(".")
        for bad in (f"{other.id}.{port}.{mac}", f"{sandbox_id}.{PORT + 1}.{mac}", "junk",
                    f"{sandbox_id}.{port}.{tampered(mac)}"):
            with pytest.raises(InvalidStatus) as refused:
                async with dial(f"{ws_url(base)}/{bad}/ws"):
                    pass
            status, response = refusal(refused)
            assert status == 401 and json.loads(response.body)["error"]["code"] == "unauthorized"
        for headers in ({}, {"Authorization": f"Bearer {token}"}):  # no key; a token is no key
            with pytest.raises(InvalidStatus) as refused:
                async with dial(f"{ws_url(srv.url)}/v1/sandboxes/{sb.id}/ports/{PORT}/ws",
                                additional_headers=headers):
                    pass
            assert refusal(refused)[0] == 401
        with pytest.raises(InvalidStatus) as refused:  # E2B without a key
            async with dial(f"{ws_url(srv.url)}/e2b/ws", additional_headers={
                    "E2b-Sandbox-Id": sb.id, "E2b-Sandbox-Port": str(PORT)}):
                pass
        assert refusal(refused)[0] == 401
        async with dial(ws_url(await other.url(PORT)) + "ws") as ws:  # its own token works
            await echoes(ws)
    finally:
        await other.stop()


async def test_what_the_sandbox_answers_instead_of_a_websocket(sb: dsec.AsyncSandbox,
                                                                srv: Server) -> None:
    base = f"{ws_url(srv.url)}/v1/sandboxes/{sb.id}/ports"
    key = auth(srv)
    # a refusal is relayed as the HTTP answer it is, with the proxy's sandbox policy
    with pytest.raises(InvalidStatus) as refused:
        async with dial(f"{base}/{PORT}/ws/refuse", additional_headers=key):
            pass
    status, response = refusal(refused)
    assert status == 403 and response.body == b"no" and response.headers["x-why"] == "refused"
    assert response.headers["content-security-policy"].startswith("sandbox ")
    # a 101 that does not answer the proxy's key, nothing listening, a bad port: typed
    for url, code in ((f"{base}/{PORT}/ws/badaccept", "port_unavailable"),
                      (f"{base}/{PORT + 1}/ws", "port_unavailable"),
                      (f"{base}/0/ws", "invalid_request"), (f"{base}/http/ws", "invalid_request")):
        with pytest.raises(InvalidStatus) as refused:
            async with dial(url, additional_headers=key):
                pass
        status, response = refusal(refused)
        assert json.loads(response.body)["error"]["code"] == code, url
        assert status == (502 if code == "port_unavailable" else 400), url
    # frames that are no frames: the client's WebSocket is closed with 1002 (protocol error)
    async with dial(f"{base}/{PORT}/ws/garbage", additional_headers=key) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1002
    # the sandbox's own close code and reason reach the client
    async with dial(f"{base}/{PORT}/ws", additional_headers=key) as ws:
        await ws.send("close")
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4000, "bye")


async def open_websockets(http: httpx.AsyncClient, box: dsec.AsyncSandbox) -> int:
    """How many WebSockets the sandbox's server has open (-1: the proxy's connections to the
    sandbox are all taken still, 502 busy: a closed client's are given back just after)."""
    r = await http.get(f"/v1/sandboxes/{box.id}/ports/{PORT}/wsopen")
    if r.status_code == 502 and r.json()["error"]["details"]["reason"] == "busy":
        return -1
    return int(r.text)


async def until_closed(http: httpx.AsyncClient, box: dsec.AsyncSandbox) -> None:
    """Until the sandbox's server has no WebSocket open (polled; the test's timeout bounds it)."""
    while await open_websockets(http, box):
        await asyncio.sleep(0.1)


async def floods_are_bounded(http: httpx.AsyncClient, box: dsec.AsyncSandbox, base: str,
                             key: dict[str, str]) -> None:
    """A flood read slowly (the port is read only as the client takes it; everything else is
    served meanwhile), a client that vanishes mid-flood without a close, a message over the
    bound (1009): each time the sandbox's side is closed after. ``base``: the port's ws URL."""
    async with dial(f"{base}/ws/flood", additional_headers=key, max_queue=1) as flood:
        for _ in range(8):
            assert len(await flood.recv()) == 1 << 20
        assert (await box.run("echo still")).stdout == "still\n"
        assert (await http.get("/v1/health")).status_code == 200
        assert await open_websockets(http, box) == 1
    await until_closed(http, box)  # the client closed: the sandbox's side is closed
    flood = await dial(f"{base}/ws/flood", additional_headers=key)
    assert len(await flood.recv()) == 1 << 20
    flood.transport.abort()  # gone without a close (under --ray: the actor's stream cancelled)
    await until_closed(http, box)
    async with dial(f"{base}/ws/huge", additional_headers=key) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    await until_closed(http, box)


async def test_floods_and_leaving_clients_are_bounded(sb: dsec.AsyncSandbox, srv: Server) -> None:
    base = f"{ws_url(srv.url)}/v1/sandboxes/{sb.id}/ports/{PORT}"
    key = auth(srv)
    async with httpx.AsyncClient(base_url=srv.url, headers=key, timeout=120) as http:
        await floods_are_bounded(http, sb, base, key)
        # the per-sandbox connection bound (64) holds WebSockets too; each is given back
        held = [await dial(f"{base}/ws", additional_headers=key) for _ in range(64)]
        try:
            with pytest.raises(InvalidStatus) as refused:
                async with dial(f"{base}/ws", additional_headers=key):
                    pass
            status, response = refusal(refused)
            assert status == 502 and json.loads(response.body)["error"]["details"]["reason"] == "busy"
        finally:
            await asyncio.gather(*(ws.close() for ws in held))
        await until_closed(http, sb)
        async with dial(f"{base}/ws", additional_headers=key) as ws:
            await echoes(ws)


async def test_a_server_that_reads_nothing_does_not_hold_the_client(
        sb: dsec.AsyncSandbox, srv: Server) -> None:
    """The client sends and the sandbox's server takes nothing: once the write into the port
    is stuck for the idle time the proxy closes both sides (1011, then uvicorn drops what the
    client still sends until its close timeout: a client busy sending may only see the
    connection end), so the client is not held. (Whether the port's side closed is not asked
    of this server: one that never reads cannot see its connection end under gVisor; the
    flood test above checks that for clients that leave.)"""
    async with dial(f"{ws_url(srv.url)}/v1/sandboxes/{sb.id}/ports/{PORT}/ws/deaf",
                    additional_headers=auth(srv)) as ws:
        with pytest.raises(ConnectionClosed):
            while True:
                await ws.send(b"d" * (1 << 20))
    async with dial(f"{ws_url(srv.url)}/v1/sandboxes/{sb.id}/ports/{PORT}/ws",
                    additional_headers=auth(srv)) as ws:  # and the port serves on
        await echoes(ws)


async def test_a_quiet_websocket_is_cut_after_the_idle_time(sb: dsec.AsyncSandbox,
                                                            srv: Server) -> None:
    """Nothing either way for DSEC_PORT_IDLE_S (3 s here): the proxy ends it (1001), and the
    sandbox's side is closed."""
    async with dial(f"{ws_url(srv.url)}/v1/sandboxes/{sb.id}/ports/{PORT}/ws",
                    additional_headers=auth(srv)) as ws:
        await echoes(ws)
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    async with httpx.AsyncClient(base_url=srv.url, headers=auth(srv)) as http:
        await until_closed(http, sb)
