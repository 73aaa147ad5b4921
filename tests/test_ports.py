"""Sandbox ports (docs/API.md "Sandbox ports"): a server listening inside a sandbox, reached
through the API server only, with the caller's key or the port's token (``sb.url``), and
what a hostile server or a hostile caller can and cannot do with that.

The server in the sandbox is tests/support/port_server.py (it reports the headers it got);
the sandboxes are containers of the default network policy (none: loopback only).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
from pathlib import Path
from typing import AsyncIterator, Iterator

import httpx
import pytest

import dsec
from conftest import VM_ACCEL, Server, make_tcp_server, stop_server

PORT = 18437  # the sandbox's server; nothing on the host listens here
SCRIPT = (Path(__file__).parent / "support" / "port_server.py").read_bytes()
IDLE_S = 3  # the server's DSEC_PORT_IDLE_S: a port silent this long is cut


@pytest.fixture(scope="module", params=["crun", "runsc"])
def srv(images: object, request: pytest.FixtureRequest) -> Iterator[Server]:
    """A TCP server (sb.url is for plain HTTP clients) of containers under each OCI runtime
    whose loopback differs: crun's is the host kernel's, runsc's gVisor's netstack."""
    if shutil.which(request.param) is None:
        pytest.skip(f"{request.param} is not installed")
    os.environ["DSEC_PORT_IDLE_S"] = str(IDLE_S)
    try:
        server = make_tcp_server("--capacity", "16", "--runtime", request.param,
                                 "--vm-accel", VM_ACCEL).start()
    finally:
        del os.environ["DSEC_PORT_IDLE_S"]
    yield server
    stop_server(server)


@pytest.fixture
async def client(srv: Server) -> AsyncIterator[dsec.DSecClient]:
    async with srv.client() as c:
        yield c


def tampered(mac: str) -> str:
    """The token's MAC with its last digit changed (always changed: never the MAC itself)."""
    return mac[:-1] + ("1" if mac.endswith("0") else "0")


async def serving(client: dsec.DSecClient, srv: Server,
                  substrate: str = "container") -> dsec.AsyncSandbox:
    """A python sandbox running port_server.py on PORT, once it answers through the proxy."""
    sb = await client.create(substrate=substrate, image="python-3.11", ttl_s=600, memory_mb=512)
    await sb.write_file("/work/port_server.py", SCRIPT)
    await sb.start(["python3", "/work/port_server.py", str(PORT)])
    async with httpx.AsyncClient(base_url=srv.url, headers=auth(srv)) as http:
        for _ in range(600):
            r = await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/headers")
            if r.status_code == 200:
                return sb
            assert r.status_code == 502 and r.json()["error"]["code"] == "port_unavailable", r.text
            await asyncio.sleep(0.05)
    pytest.fail("the sandbox's server did not come up")


def auth(srv: Server) -> dict[str, str]:
    return {"authorization": f"Bearer {srv.key}"}


@pytest.fixture
async def sb(client: dsec.DSecClient, srv: Server) -> AsyncIterator[dsec.AsyncSandbox]:
    box = await serving(client, srv)
    yield box
    await box.stop()


def seen(response: httpx.Response) -> dict[str, str]:
    """The headers the sandbox's server got (lower-cased names), and its request path."""
    assert response.status_code == 200, response.text
    return {k.lower(): v for k, v in response.json()}


async def assert_the_port_serves(http: httpx.AsyncClient, srv: Server, sandbox_id: str,
                                 n: int) -> None:
    """Through the key route: the caller's key stripped, an answer of ``n`` bytes whole, and
    a port nothing listens on typed ``port_unavailable``."""
    got = seen(await http.get(f"/v1/sandboxes/{sandbox_id}/ports/{PORT}/headers",
                              headers={"x-api-key": srv.key}))
    assert got["path"] == "/headers" and "x-api-key" not in got
    r = await http.get(f"/v1/sandboxes/{sandbox_id}/ports/{PORT}/big?n={n}")
    assert r.status_code == 200 and len(r.content) == n
    r = await http.get(f"/v1/sandboxes/{sandbox_id}/ports/{PORT + 1}/")
    assert r.status_code == 502 and r.json()["error"]["code"] == "port_unavailable"


async def test_the_key_and_the_port_token_reach_the_port(sb: dsec.AsyncSandbox, srv: Server) -> None:
    async with httpx.AsyncClient(base_url=srv.url) as http:
        r = await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/headers?a=1&b=%2F", headers=auth(srv))
        assert seen(r)["path"] == "/headers?a=1&b=%2F"  # path and query as they came
        assert seen(r)["host"] == f"localhost:{PORT}"
        # the sandbox's pages run in an opaque origin in a browser (control/ports.py)
        assert r.headers["content-security-policy"].startswith("sandbox ")
        assert "allow-same-origin" not in r.headers["content-security-policy"]
        # without a key: refused on the key route
        assert (await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/headers")).status_code == 401
    url = await sb.url(PORT)
    assert url.startswith(srv.url + "/v1/ports/") and url.endswith("/")
    async with httpx.AsyncClient() as plain:  # no key at all: the token is the access
        assert seen(await plain.get(url + "headers"))["path"] == "/headers"
        r = await plain.post(url + "echo", content=b"\x00body\xff" * 1000)
        assert r.status_code == 200 and r.content == b"\x00body\xff" * 1000
        assert (await plain.get(url.rstrip("/"))).status_code == 404  # the root: the server's own 404
        head = await plain.head(url + "big?n=5000")
        assert head.status_code == 200 and head.headers["content-length"] == "5000"
        assert head.content == b""


def test_the_blocking_sdk_gives_the_same_url(sb: dsec.AsyncSandbox, srv: Server) -> None:
    with dsec.Client(srv.url, srv.key) as blocking:
        url = blocking.get(sb.id).url(PORT)
    assert seen(httpx.get(url + "headers"))["path"] == "/headers"


async def test_the_callers_credentials_never_reach_the_sandbox(sb: dsec.AsyncSandbox,
                                                              srv: Server) -> None:
    sent = {"x-api-key": srv.key, "cookie": f"k={srv.key}", "x-dsec-step": "1",
            "x-access-token": "tok", "e2b-sandbox-id": sb.id, "proxy-authorization": srv.key,
            "x-mine": "kept"}
    async with httpx.AsyncClient(base_url=srv.url, headers=auth(srv)) as http:
        got = seen(await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/headers", headers=sent))
    assert got["x-mine"] == "kept"
    assert not {"authorization", "x-api-key", "cookie", "x-dsec-step", "x-access-token",
                "e2b-sandbox-id", "proxy-authorization"} & set(got)
    assert srv.key not in json.dumps(got)
    url = await sb.url(PORT)
    token = url.rstrip("/").rsplit("/", 1)[1]
    async with httpx.AsyncClient() as plain:
        got = seen(await plain.get(url + "headers"))
    assert token not in json.dumps({k: v for k, v in got.items() if k != "path"})


async def test_a_token_opens_its_own_port_of_its_own_sandbox_only(
        client: dsec.DSecClient, sb: dsec.AsyncSandbox, srv: Server) -> None:
    other = await serving(client, srv)
    try:
        url = await sb.url(PORT)
        base, token = url.rstrip("/").rsplit("/", 1)
        sandbox_id, port, mac = token.split(".")
        forged = [f"{other.id}.{port}.{mac}", f"{sandbox_id}.{PORT + 1}.{mac}",
                  f"{sandbox_id}.{port}.{tampered(mac)}", f"{sandbox_id}.{port}", "junk", f"{other.id}"]
        async with httpx.AsyncClient() as plain:
            for bad in forged:
                r = await plain.get(f"{base}/{bad}/headers")
                assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", bad
            # the other sandbox's own token works for it: the refusals above are the token's
            assert seen(await plain.get(await other.url(PORT) + "headers"))
        # the token is no API key: the key routes refuse it
        async with httpx.AsyncClient(base_url=srv.url,
                                     headers={"authorization": f"Bearer {token}"}) as http:
            assert (await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/headers")).status_code == 401
            assert (await http.get("/v1/sandboxes")).status_code == 401
        await other.stop()
        async with httpx.AsyncClient() as plain:  # a token dies with its sandbox
            r = await plain.get(await sb.url(PORT) + "headers")
            assert r.status_code == 200
            r = await plain.get(f"{base}/{other.id}.{port}.{mac}/headers")
            assert r.status_code == 401
    finally:
        try:
            await other.stop()
        except dsec.DSecError:
            pass


async def test_a_stopped_sandboxs_token_is_refused(client: dsec.DSecClient, srv: Server) -> None:
    box = await serving(client, srv)
    url = await box.url(PORT)
    await box.stop()
    async with httpx.AsyncClient() as plain:
        r = await plain.get(url + "headers")
    assert r.status_code in (404, 410), r.text


async def test_nothing_listening_is_a_typed_error(sb: dsec.AsyncSandbox, srv: Server) -> None:
    async with httpx.AsyncClient(base_url=srv.url, headers=auth(srv)) as http:
        r = await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT + 1}/")
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["code"] == "port_unavailable" and error["details"]["port"] == PORT + 1
        assert "nothing answers" in error["message"]
        for bad in ("0", "65536", "-1", "http"):
            r = await http.get(f"/v1/sandboxes/{sb.id}/ports/{bad}/")
            assert r.status_code == 400, bad
        r = await http.get(f"/v1/sandboxes/sb-nope-000000/ports/{PORT}/")
        assert r.status_code == 404


async def test_an_answer_that_is_not_http_or_too_big_a_head_is_a_typed_error(
        sb: dsec.AsyncSandbox, srv: Server) -> None:
    async with httpx.AsyncClient(base_url=srv.url, headers=auth(srv)) as http:
        for page in ("hugehead", "garbage"):
            r = await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/{page}")
            assert r.status_code == 502, page
            assert r.json()["error"]["code"] == "port_unavailable", page
        r = await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/chunked")
        assert r.status_code == 200 and r.content == b"hello world"
        # the server's own policy can only add to the proxy's sandbox policy, never replace it
        policies = r.headers.get_list("content-security-policy")
        assert "default-src *" in policies and any(p.startswith("sandbox ") for p in policies)


async def test_a_large_answer_streams_through(sb: dsec.AsyncSandbox, srv: Server) -> None:
    n = (96 << 20) + 12345
    got = 0
    async with httpx.AsyncClient(base_url=srv.url, headers=auth(srv), timeout=120) as http:
        async with http.stream("GET", f"/v1/sandboxes/{sb.id}/ports/{PORT}/big?n={n}") as r:
            assert r.status_code == 200 and int(r.headers["content-length"]) == n
            async for chunk in r.aiter_raw():
                got += len(chunk)
    assert got == n


async def test_a_redirect_to_the_api_server_is_passed_back_not_followed(
        client: dsec.DSecClient, sb: dsec.AsyncSandbox, srv: Server) -> None:
    before = {s.id for s in await client.list()}
    to = f"{srv.url}/v1/sandboxes/{sb.id}"
    async with httpx.AsyncClient(base_url=srv.url, headers=auth(srv)) as http:
        r = await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/redirect",
                           params={"to": to}, follow_redirects=False)
    assert r.status_code == 302 and r.headers["location"] == to
    assert {s.id for s in await client.list()} == before
    assert (await client.get(sb.id)).info.state == "running"


async def test_the_sandbox_reaches_neither_the_api_server_nor_the_host(sb: dsec.AsyncSandbox,
                                                                       srv: Server) -> None:
    """The default policy (no network) holds while the port is served: from inside, the API
    server, the host and the internet are out of reach; from the host, the sandbox's port is
    not open (no host port: only the proxy reaches it)."""
    host_ip = socket.gethostbyname(socket.gethostname())
    api_port = srv.url.rsplit(":", 1)[1]
    async with httpx.AsyncClient(base_url=srv.url, headers=auth(srv)) as http:
        for url in (f"{srv.url}/v1/health", f"http://{host_ip}:{api_port}/v1/health",
                    "http://1.1.1.1/", f"http://10.0.2.2:{api_port}/"):
            r = await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/reach", params={"url": url})
            assert r.status_code == 200 and r.text.startswith("failed"), (url, r.text)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", PORT), timeout=2).close()


async def test_a_flooding_or_silent_server_does_not_hold_the_api_server(
        client: dsec.DSecClient, sb: dsec.AsyncSandbox, srv: Server) -> None:
    async with httpx.AsyncClient(base_url=srv.url, headers=auth(srv), timeout=120) as http:
        silent = asyncio.ensure_future(http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/silent"))
        async with http.stream("GET", f"/v1/sandboxes/{sb.id}/ports/{PORT}/flood") as flood:
            taken = 0
            async for chunk in flood.aiter_raw():
                taken += len(chunk)
                if taken > 32 << 20:
                    break  # the client stops reading: the proxy stops reading the port
            # meanwhile the API server and the sandbox serve everything else
            assert seen(await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/headers"))
            assert (await sb.run("echo still")).stdout == "still\n"
            assert (await http.get("/v1/health")).status_code == 200
        r = await silent  # cut after DSEC_PORT_IDLE_S without a byte
        assert r.status_code == 502 and r.json()["error"]["code"] == "port_unavailable"
        assert "gave no HTTP answer" in r.json()["error"]["message"]
    # the abandoned connections are given back: more requests than the bound (64 open at
    # once per sandbox) pass one after another; a burst over it is refused, typed, in part
    async with httpx.AsyncClient(base_url=srv.url, headers=auth(srv), timeout=120) as http:
        for _ in range(70):
            assert seen(await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/headers"))
        for _ in range(70):  # floods left after one chunk: each gives its connection back
            async with http.stream("GET", f"/v1/sandboxes/{sb.id}/ports/{PORT}/flood") as flood:
                async for _chunk in flood.aiter_raw():
                    break
        assert seen(await http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/headers"))
        rs = await asyncio.gather(*(http.get(f"/v1/sandboxes/{sb.id}/ports/{PORT}/headers")
                                    for _ in range(100)))
    for r in rs:
        assert r.status_code == 200 or (r.status_code == 502 and
                                        r.json()["error"]["details"]["reason"] == "busy"), r.text


async def test_a_microvm_serves_its_port_through_its_guest_agent(client: dsec.DSecClient,
                                                                srv: Server) -> None:
    """A VM's agent connects inside the guest: the same proxy, the same stripping, no port
    opened on the host (the guest has no network)."""
    if "runsc" in srv.args:
        pytest.skip("one VM case is enough: it runs under the crun server")
    vm = await serving(client, srv, substrate="microvm")
    try:
        async with httpx.AsyncClient(base_url=srv.url, headers=auth(srv), timeout=120) as http:
            await assert_the_port_serves(http, srv, vm.id, (8 << 20) + 3)
            r = await http.get(f"/v1/sandboxes/{vm.id}/ports/{PORT}/reach",
                               params={"url": f"{srv.url}/v1/health"})
            assert r.text.startswith("failed"), r.text
        async with httpx.AsyncClient(timeout=120) as plain:
            assert seen(await plain.get(await vm.url(PORT) + "headers"))["path"] == "/headers"
    finally:
        await vm.stop()
