"""Dockerfile builds through the server (``POST /v1/images/build``, ``Client.build_image``):
the same build as ``dsec image build -f`` (edge/dockerbuild.py), run on an edge of a real
server, its progress streamed, its image then run by the server. Hostile cases as a cheating
client or Dockerfile would try them: context tars with escapes and bombs, a COPY of a host
file, RUN output with terminal escapes and floods, another project's key using a build's image,
a RUN reaching the API server or the network without an allow.

Every Dockerfile declares ``ARG NONCE`` given the test-unique name: the steps' cache keys are
this run's own (the images cache is shared and keeps layers).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import dsec
from conftest import DEST_PORTS, Server, free_port, own_server
from dsec.images.store import ImageStore
from dsec.network.testbed import Destination
from test_projects import unique

pytestmark = pytest.mark.usefixtures("images")


# on every address of the host (a RUN step could try any of them to reach it)
srv, client = own_server("--host", "0.0.0.0", "--port", str(free_port()), "--warm-pool", "0")


def dockerfile(name: str, body: str, base: str = "debian-minbase") -> str:
    return f"FROM {base}\nARG NONCE={name}\n{body}"


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def member(name: str, data: bytes = b"x", **fields: object) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in fields.items():
        setattr(info, key, value)
    return info, data if info.type in (tarfile.REGTYPE, tarfile.AREGTYPE) else None


async def run_in(client: dsec.DSecClient, image: str, command: str) -> dsec.ExecResult:
    async with await client.create(image=image, ttl_s=120) as sb:
        return await sb.run(command, timeout_s=60)


PROJECT = """\
ENV APP_HOME=/srv/app
WORKDIR $APP_HOME
COPY src/ ./src/
RUN echo "built $(cat src/hello.txt) $(od -An -N8 -tx8 /dev/urandom)" > stamp.txt && echo step-output
CMD ["cat", "stamp.txt"]
"""


async def test_build_streams_progress_then_runs_and_is_cached(
        client: dsec.DSecClient, srv: Server, tmp_path: Path, name: str) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "hello.txt").write_text("hello\n")
    (tmp_path / "Dockerfile").write_text(dockerfile(name, PROJECT))
    lines: list[str] = []
    built = await client.build_image(name, tmp_path, on_log=lines.append)
    assert (built.image, built.steps_run, built.steps_cached) == (name, 3, 0)  # admin: as named
    assert built.digest == ImageStore().get(name).digest
    assert any("line 6: RUN" in line for line in lines), lines
    assert any(line == "  │ step-output" for line in lines), lines  # a RUN's output, streamed
    r = await run_in(client, built.image, "pwd; cat stamp.txt")
    assert r.stdout.splitlines()[0] == "/srv/app"
    stamp = r.stdout.splitlines()[1]
    assert stamp.startswith("built hello ")

    def blocking() -> dsec.ImageBuilt:  # the blocking client, the same call
        with dsec.Client(srv.url, srv.key, autostart=False) as blocking_client:
            return blocking_client.build_image(name, tmp_path)
    again = await asyncio.to_thread(blocking)
    assert (again.steps_run, again.steps_cached, again.digest) == (0, 3, built.digest)
    assert (await run_in(client, name, "cat stamp.txt")).stdout.strip() == stamp  # not run again


async def test_cli_builds_on_the_server_with_server(srv: Server, tmp_path: Path,
                                                        name: str) -> None:
    (tmp_path / "Dockerfile").write_text(dockerfile(name, "RUN echo from-the-cli > /cli.txt\n"))
    proc = subprocess.run(
        [sys.executable, "-m", "dsec", "image", "build", "-f", str(tmp_path / "Dockerfile"),
         str(tmp_path), "--name", name, "--server"],
        env={**os.environ, "DSEC_URL": srv.url, "DSEC_API_KEY": srv.key, "COLUMNS": "400",
             "DSEC_STATE_DIR": str(tmp_path / "no-local-state")},
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split()[0] == name and "1 steps run, 0 cached" in proc.stderr
    assert "line 3: RUN echo from-the-cli" in proc.stderr  # the progress, streamed
    assert not (tmp_path / "no-local-state").exists()  # no local builder edge: the server's
    async with srv.client() as client:
        assert (await run_in(client, name, "cat /cli.txt")).stdout == "from-the-cli\n"


@pytest.mark.parametrize(("text", "error"), [
    ("RUN echo before-from\nFROM debian-minbase\n", dsec.InvalidRequest),
    ("FROM debian-minbase\nFROBNICATE x\n", dsec.InvalidRequest),
    ("ARG ONLY=1\n", dsec.InvalidRequest),
    ("FROM debian-minbase AS a\nFROM a\n", dsec.NotSupported),
])
async def test_a_bad_dockerfile_is_a_4xx_and_nothing_is_built(
        client: dsec.DSecClient, name: str, text: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        await client.build_image(name, dockerfile=text)
    with pytest.raises(dsec.ImageNotFound):
        ImageStore().get(name)


def test_a_malformed_build_request_is_a_typed_400(srv: Server) -> None:
    with srv.http(authenticated=True) as http:
        for kwargs in ({"content": b"not multipart"},
                       {"files": {"context": ("c.tar", b"", "application/x-tar")}},
                       {"files": {"request": (None, json.dumps({"name": "x"}), "application/json")}},
                       {"files": {"request": (None, json.dumps({"name": "x", "dockerfile": "FROM a",
                                                                "extra": 1}), "application/json")}}):
            r = http.post("/v1/images/build", **kwargs)  # type: ignore[arg-type]
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "invalid_request"
        r = http.post("/v1/images/build", files={"request": (None, json.dumps(
            {"name": "bad name/../x", "dockerfile": "FROM debian-minbase\n"}), "application/json")})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    with srv.http() as http:  # no key
        assert http.post("/v1/images/build", content=b"").status_code == 401


@pytest.mark.parametrize("context", [
    [member("../escaped.txt")],
    [member("/abs-escape.txt")],
    [member("out", type=tarfile.SYMTYPE, linkname="/etc"), member("out/passwd")],
    [member("link", type=tarfile.SYMTYPE, linkname="../../../../etc/passwd")],
    [member("hard", type=tarfile.LNKTYPE, linkname="/etc/passwd")],
    [member("dev", type=tarfile.CHRTYPE, devmajor=1, devminor=3)],
], ids=["dotdot", "absolute", "through-symlink", "symlink-out", "hardlink-out", "device"])
async def test_hostile_context_tars_are_refused(client: dsec.DSecClient, name: str,
                                                tmp_path: Path, context: list) -> None:
    with pytest.raises(dsec.UnsafeArchive):
        await client.build_image(name, tar_of(*context),
                                dockerfile=dockerfile(name, "COPY . /ctx/\n"))
    with pytest.raises(dsec.ImageNotFound):
        ImageStore().get(name)
    assert not Path("/escaped.txt").exists() and not Path("/abs-escape.txt").exists()


async def test_a_context_bomb_is_refused(client: dsec.DSecClient, name: str) -> None:
    """A sparse member claiming a TiB from a tiny tar, and a member count bomb."""
    sparse, data = member("bomb", b"x")
    sparse.pax_headers = {"GNU.sparse.map": "0,1", "GNU.sparse.size": str(1 << 40)}
    many = tar_of(*(member(f"f{i}", b"") for i in range(100_001)))
    for bomb in (tar_of((sparse, data)), many):
        with pytest.raises(dsec.UnsafeArchive):
            await client.build_image(name, bomb, dockerfile=dockerfile(name, "COPY . /ctx/\n"))
    with pytest.raises(dsec.ImageNotFound):
        ImageStore().get(name)


@pytest.mark.parametrize("copy", ["COPY /etc/passwd /x", "COPY ../../../etc/passwd /x",
                                  "COPY link /x"])
async def test_copy_of_a_host_file_outside_the_context_is_refused(
        client: dsec.DSecClient, name: str, copy: str) -> None:
    context = tar_of(member("link", type=tarfile.SYMTYPE, linkname="inside.txt"),
                     member("inside.txt", b"fine\n"))
    body = copy + "\nRUN cat /x\n"
    if copy == "COPY link /x":  # a source that is a link inside the context: its file
        lines: list[str] = []
        built = await client.build_image(name, context, dockerfile=dockerfile(name, body),
                                        on_log=lines.append)
        assert built.steps_run == 2 and "  │ fine" in lines
        return
    with pytest.raises(dsec.InvalidRequest, match="build context"):
        await client.build_image(name, context, dockerfile=dockerfile(name, body))
    with pytest.raises(dsec.ImageNotFound):
        ImageStore().get(name)


async def test_run_output_with_escapes_and_floods_is_bounded_plain_text(
        client: dsec.DSecClient, name: str) -> None:
    flood = ("RUN printf 'evil\\033]52;c;aGk=\\a\\033[2J\\r\\n'; "
             "head -c 3000000 /dev/zero | tr '\\0' 'y' | fold -w 1000\n")
    lines: list[str] = []
    built = await client.build_image(name, dockerfile=dockerfile(name, flood), on_log=lines.append)
    assert built.steps_run == 1
    assert all(c.isprintable() for line in lines for c in line)  # no escapes, no \r
    assert any(line.startswith("  │ evil") for line in lines)
    output = [line for line in lines if line.startswith("  │")]
    assert sum(map(len, output)) < (1 << 20) + 2000  # 3 MB printed, about 1 MiB streamed
    assert "is not shown" in output[-1]
    failing = "RUN printf 'bad\\033[31mred\\n'; head -c 200000 /dev/zero | tr '\\0' z; exit 7\n"
    name += "-failing"
    with pytest.raises(dsec.ImageBuildError) as caught:
        await client.build_image(name, dockerfile=dockerfile(name, failing))
    assert caught.value.details["exit_code"] == 7 and caught.value.details["line"] == 3
    assert len(caught.value.details["output"]) <= 4096  # a bounded tail
    assert "\x1b" not in caught.value.message
    with pytest.raises(dsec.ImageNotFound):
        ImageStore().get(name)


async def test_a_projects_build_is_its_own(srv: Server, client: dsec.DSecClient,
                                          name: str) -> None:
    keys = []
    for prefix in ("build-mine", "build-theirs"):
        project = unique(prefix)
        await client.projects().create(project, sandboxes=4, cpu=8, memory_mb=4096)
        keys.append((project, (await client.projects().create_key(project, "sdk")).key))
    (mine, my_key), (theirs, their_key) = keys
    text = dockerfile(name, "RUN echo secret-of-mine > /mine.txt\n")
    async with dsec.DSecClient(srv.url, my_key, autostart=False) as me, \
            dsec.DSecClient(srv.url, their_key, autostart=False) as them:
        built = await me.build_image(name, dockerfile=text)
        assert built.image == f"p.{mine}.{name}"
        assert (await run_in(me, built.image, "cat /mine.txt")).stdout == "secret-of-mine\n"
        with pytest.raises(dsec.ImageNotFound):  # their key: no sandbox of it
            await them.create(image=built.image, ttl_s=60)
        with pytest.raises(dsec.ImageNotFound):  # nor a build on it
            await them.build_image(name + "-2", dockerfile=f"FROM {built.image}\nRUN true\n")
        with pytest.raises(dsec.ImageNotFound):  # nor an fn call in it
            await them.run_code("bash", "cat /mine.txt", image=built.image)
        with pytest.raises(dsec.InvalidRequest):  # nor a name in my namespace
            await them.build_image(f"p.{mine}.{name}", dockerfile=text)
        with pytest.raises(dsec.QuotaExceeded):  # a build holds its step sandbox's share
            await them.build_image(name, dockerfile=text, cpu=16)
        theirs_built = await them.build_image(name, dockerfile=dockerfile(
            name, "RUN echo theirs > /mine.txt\n"))
        assert theirs_built.image == f"p.{theirs}.{name}"  # same name, their own image
        assert (await run_in(me, built.image, "cat /mine.txt")).stdout == "secret-of-mine\n"
    used = (await client.projects().get(theirs)).used
    assert (used.sandboxes, used.memory_mb) == (0, 0)  # the builds' holds went back


async def test_run_reaches_neither_the_api_server_nor_the_network_without_an_allow(
        client: dsec.DSecClient, srv: Server, name: str, dest: Destination) -> None:
    port = srv.args[srv.args.index("--port") + 1]
    # the host's address, the sandbox's gateway (the host side of its link), a metadata-style
    # address: none is the API server's to a build step, allowed or not
    gateway = ('$(while read -r _ d g _; do [ "$d" = 00000000 ] && printf "%d.%d.%d.%d" '
               '0x$(echo $g | cut -c7-8) 0x$(echo $g | cut -c5-6) 0x$(echo $g | cut -c3-4) '
               '0x$(echo $g | cut -c1-2); done < /proc/net/route)')  # RUN's sh is dash
    targets = [f"192.0.2.2/{port}", f"{gateway}/{port}", f"169.254.169.254/{port}",
               f"{dest.address}/{DEST_PORTS[0]}"]
    probe = ("RUN for target in " + " ".join(targets) + "; do "
             "if timeout 10 bash -c \"exec 3<>/dev/tcp/$target\" 2>/dev/null; "
             "then echo reached $target; else echo refused $target; fi; done "
             "| tee /probe.txt\n")
    offline = dockerfile(name, probe)
    built = await client.build_image(name, dockerfile=offline)
    r = await run_in(client, built.image, "cat /probe.txt")
    assert "reached" not in r.stdout and r.stdout.count("refused") == 4, r.stdout
    allowed = await client.build_image(
        name, dockerfile=offline.replace("/probe.txt", "/probe2.txt"),
        network={"allow": [f"{dest.address}:{DEST_PORTS[0]}"]})
    r = await run_in(client, allowed.image, "cat /probe2.txt")
    assert f"reached {dest.address}/{DEST_PORTS[0]}" in r.stdout, r.stdout
    assert r.stdout.count("reached") == 1, r.stdout  # the API server stays out of reach
    assert f"refused /{port}" not in r.stdout  # the gateway was found (routed when allowed)
