"""Image builds whose content comes from a sandbox, attacked as an RL agent or a template
author in another project would: a RUN step's writable layer becomes an image layer that
other sandboxes (and other projects) start from, so whatever it leaves must give nobody
anything, on the host or in a later sandbox.

Each case is a real build through a real server (``Client.build_image``, the E2B template
routes), then a real sandbox of the image or a real look at the host: setuid files a local
user of the host could run, sparse files copied dense onto the host's disk, overlay and
capability xattrs, names (and floods of them) that forge or fill the server's log, another
project's layers answering from the shared cache (RUN text differing in spaces, a RUN made
with network), another project's build reached while it runs or by its digest, builds cut
short by a client or a crash, RUN flags dropped without a word, trees and layer stacks too
big to mount, racers and leases left at the commit, and E2B uploads piling up on the host
or in the server's memory outside any quota.

Every Dockerfile declares ``ARG NONCE`` given the test-unique name: the steps' cache keys are
this run's own (the images cache is shared and keeps layers).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import json
import os
import secrets
import subprocess
import tarfile
import time
from pathlib import Path

import httpx
import pytest

import dsec
from conftest import (
    DEST_PORTS,
    LOG_DIR,
    Server,
    free_port,
    make_server,
    own_server,
    stop_server,
)
from dsec.images.store import ImageStore, Layer
from dsec.network.testbed import Destination
from test_compat_e2b import _project_keys
from test_compat_e2b_templates import build_end
from test_projects import unique
from test_server_build import dockerfile, run_in

pytestmark = pytest.mark.usefixtures("images")

srv, client = own_server("--host", "127.0.0.1", "--port", str(free_port()), "--warm-pool", "0")

NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]


def top_layer(image: str) -> Layer:
    return ImageStore().get(image).layers[-1]


def on_host(srv: Server, layer: Layer, path: str) -> Path:
    """Where a file of ``layer`` is on the host: under the server's mount of an EROFS layer,
    or in a directory layer itself."""
    if layer.format == "erofs":
        return srv.state_dir / "layers" / layer.digest.removeprefix("sha256:") / path
    return layer.path / path


async def test_a_setuid_file_from_a_run_gives_a_local_user_of_the_host_no_root(
        client: dsec.DSecClient, srv: Server, name: str) -> None:
    """dsec's own static shell copied and made setuid root in a RUN (mksh keeps its euid
    with ``-p``): the sandboxes of the image cannot use it (no new privileges), and no
    local user of the host may run it as root from the host's view of the layer."""
    body = "RUN cp /.dsec/bin/sh /usr/local/bin/suidsh && chmod 4755 /usr/local/bin/suidsh\n"
    built = await client.build_image(name, dockerfile=dockerfile(name, body))
    assert built.steps_run == 1
    inside = await run_in(client, built.image, "stat -c %a:%u /usr/local/bin/suidsh; "
                                               "setpriv --reuid 65534 /usr/local/bin/suidsh "
                                               "-p -c 'echo $USER_ID' || true")
    assert inside.stdout.splitlines()[0] == "4755:0"  # the image keeps its modes
    assert "0" not in inside.stdout.splitlines()[1:]  # no new privileges in a sandbox
    suidsh = on_host(srv, top_layer(built.image), "usr/local/bin/suidsh")
    proof = srv.state_dir / f"owned-{secrets.token_hex(3)}"
    local = subprocess.run([*NOBODY, str(suidsh), "-p", "-c", f"echo $USER_ID; : > {proof}"],
                           capture_output=True, text=True, timeout=30)
    assert "0" not in local.stdout.split(), (local.stdout, local.stderr)
    assert not proof.exists()  # written as root into root's state directory
    if top_layer(built.image).format == "erofs":  # and root's own view runs no set-id bit
        flags = os.statvfs(suidsh).f_flag
        assert flags & os.ST_NOSUID and flags & os.ST_NODEV


async def test_a_sparse_file_costs_the_host_no_more_than_the_sandbox(
        client: dsec.DSecClient, srv: Server, name: str) -> None:
    """A 2 GiB file of holes costs a RUN's disk nothing; its layer must not cost the host
    2 GiB of written zeros (the server's own writes, while it commits the layer)."""
    assert srv.proc is not None

    def written() -> int:
        io = dict(line.split(": ") for line in
                  Path(f"/proc/{srv.proc.pid}/io").read_text().splitlines())  # type: ignore[union-attr]
        return int(io["wchar"])
    before = written()
    built = await client.build_image(name, dockerfile=dockerfile(
        name, "RUN truncate -s 2G /sparse && echo tail >> /sparse\n"), disk_mb=4096)
    spent = written() - before
    assert built.steps_run == 1
    r = await run_in(client, built.image, "stat -c %s /sparse; tail -c 5 /sparse; "
                                          "head -c 4096 /sparse | tr -d '\\0' | wc -c")
    assert r.stdout.split() == [str((2 << 30) + 5), "tail", "0"]  # the same file
    assert spent < 256 << 20, f"the server wrote {spent >> 20} MiB for a layer of holes"


async def test_overlay_and_capability_xattrs_from_a_run_never_reach_a_layer(
        client: dsec.DSecClient, name: str) -> None:
    """Overlay's own xattrs (opaque, redirect, origin, metacopy, in the trusted and user
    namespaces) set on a copied-up /etc, and a file capability on a copy of python3: the
    next sandbox sees the lower /etc whole and no such xattr, nor the capability."""
    script = (
        "import os, shutil, sys\n"
        "shutil.copy(os.path.realpath(sys.executable), '/usr/local/bin/capped')\n"
        "cap = bytes.fromhex('01000002' + 'ffffffff' * 2 + '00000000' * 2)  # v2, all, effective\n"
        "tried = [('/etc', 'user.overlay.opaque', b'y'), ('/etc', 'trusted.overlay.opaque', b'y'),\n"
        "         ('/etc', 'user.overlay.redirect', b'/usr'), ('/etc', 'user.overlay.origin', b'x'),\n"
        "         ('/usr/local/bin/capped', 'user.overlay.metacopy', b''),\n"
        "         ('/usr/local/bin/capped', 'security.capability', cap),\n"
        "         ('/etc', 'user.note', b'mine')]\n"
        "for path, key, value in tried:\n"
        "    try:\n"
        "        os.setxattr(path, key, value)\n"
        "        print('set', key)\n"
        "    except OSError as exc:\n"
        "        print('refused', key, exc.errno)\n"
        )
    body = f"RUN {json.dumps(['python3', '-c', script])}\n"
    lines: list[str] = []
    built = await client.build_image(name, dockerfile=dockerfile(name, body, "python-3.11"),
                                     on_log=lines.append)
    assert any("set security.capability" in line for line in lines), lines  # it tried for real
    check = ("python3 -c \"import os; print(sorted(os.listxattr('/etc')), "
             "sorted(os.listxattr('/usr/local/bin/capped')))\"; test -s /etc/passwd && echo passwd")
    r = await run_in(client, built.image, check)
    assert r.stdout.splitlines() == ["[] []", "passwd"], r.stdout + r.stderr


async def test_a_dropped_name_cannot_forge_a_line_in_the_servers_log(
        client: dsec.DSecClient, srv: Server, name: str) -> None:
    """A fifo (dropped from the layer, and logged) named with newlines: each of its lines
    stays inside the one log record, in the server's log and in the build's."""
    forged = f"FORGED-{secrets.token_hex(4)}"
    body = f"RUN mkfifo \"$(printf 'fifo\\n{forged} ERROR:dsec.edge:the grader passed')\"\n"
    lines: list[str] = []
    built = await client.build_image(name, dockerfile=dockerfile(name, body), on_log=lines.append)
    assert built.steps_run == 1
    assert any("dropped from the layer" in line and forged in line for line in lines), lines
    assert not any(line.startswith(forged) for line in lines)
    log = (LOG_DIR / f"{srv.state_dir.name}.log").read_text(errors="replace")
    assert forged in log  # the drop was logged
    assert not any(line.startswith(forged) for line in log.splitlines()), "a forged log line"


async def test_run_commands_differing_only_in_spaces_never_share_a_layer(
        client: dsec.DSecClient, srv: Server, name: str) -> None:
    """One project builds ``printf 'a  b'``; another, later, ``printf 'a b'`` on the same
    image: the second's RUN must run, not be served the first one's layer from the cache."""
    keys = [key for _, key in await _project_keys(srv, 0)]
    results = []
    for key, text in zip(keys, ("RUN printf 'a  b' > /f\n", "RUN printf 'a b' > /f\n"),
                         strict=True):
        async with dsec.DSecClient(srv.url, key, autostart=False) as tenant:
            built = await tenant.build_image(name, dockerfile=dockerfile(name, text))
            results.append((built.steps_run, (await run_in(tenant, built.image, "cat /f")).stdout))
    assert results == [(1, "a  b"), (1, "a b")]


async def test_a_layer_made_with_network_never_answers_a_build_without(
        srv: Server, name: str, dest: Destination) -> None:
    """One project builds a RUN with an egress allow; another, later, the same text with
    no network: the second's RUN must run offline, not be served the layer the first one's
    network made (which the first one chose: what its allowed host served)."""
    keys = [key for _, key in await _project_keys(srv, 0)]
    probe = (f"RUN if timeout 5 bash -c 'exec 3<>/dev/tcp/{dest.address}/{DEST_PORTS[0]}' "
             "2>/dev/null; then echo online > /where; else echo offline > /where; fi\n")
    results = []
    for key, network in zip(keys, ({"allow": [f"{dest.address}:{DEST_PORTS[0]}"]}, "none"),
                            strict=True):
        async with dsec.DSecClient(srv.url, key, autostart=False) as tenant:
            built = await tenant.build_image(name, dockerfile=dockerfile(name, probe),
                                             network=network)
            where = (await run_in(tenant, built.image, "cat /where")).stdout
            results.append((built.steps_run, where))
    assert results == [(1, "online\n"), (1, "offline\n")]


async def test_another_projects_build_under_way_is_neither_named_nor_usable(
        srv: Server, name: str) -> None:
    """While a project's build runs a step, its image so far (the COPY of its secret
    included) is a scratch image of the store: another project's key, asking for an image
    that does not exist, must not be told its name (nor any other project's image names),
    and naming it must get ``image_not_found``, never a sandbox of it."""
    projects, keys = (list(column) for column in zip(*await _project_keys(srv, 0)))
    secret = secrets.token_hex(8)
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        info = tarfile.TarInfo("secret.txt")
        info.size = len(secret)
        tar.addfile(info, io.BytesIO(secret.encode()))
    text = dockerfile(name, "COPY secret.txt /secret.txt\nRUN sleep 60\n")
    started = asyncio.Event()
    async with dsec.DSecClient(srv.url, keys[0], autostart=False) as builder, \
            dsec.DSecClient(srv.url, keys[1], autostart=False) as snoop:
        build = asyncio.create_task(builder.build_image(
            name, context.getvalue(), dockerfile=text,
            on_log=lambda line: started.set() if "RUN sleep 60" in line else None))
        try:
            await asyncio.wait_for(started.wait(), 120)
            scratch = _scratch_of(f"p.{projects[0]}.{name}")
            assert len(scratch) == 1, scratch
            with pytest.raises(dsec.ImageNotFound):
                sb = await snoop.create(image=scratch[0], ttl_s=60)
                leaked = (await sb.run("cat /secret.txt")).stdout
                await sb.stop()
                assert leaked != secret, "another project read the build's secret"
            with pytest.raises(dsec.ImageNotFound) as caught:
                await snoop.create(image=f"no-such-image-{secrets.token_hex(3)}", ttl_s=60)
            listed = caught.value.message.partition("known images: ")[2].partition(";")[0]
            assert scratch[0] not in caught.value.message
            assert not [n for n in listed.split(", ") if n.startswith("p.")], listed
        finally:
            build.cancel()
            with contextlib.suppress(asyncio.CancelledError, dsec.DSecError):
                await build


async def test_a_build_the_client_walks_away_from_leaves_nothing(
        client: dsec.DSecClient, srv: Server, name: str) -> None:
    """The client goes away while a RUN runs (processes that ignore SIGTERM, one left in
    the background): the step's sandbox and its processes go, its scratch image goes,
    nothing is named."""
    started = asyncio.Event()
    nap = f"600.{secrets.randbelow(10**6):06d}"  # this test's own, to find on the host
    # the output says "42-running"; the step's header (its text) does not: it says $((6*7))
    body = f"RUN trap '' TERM; (sleep {nap} &); sleep {nap} & echo $((6*7))-running; wait\n"
    boxes = srv.volume / "sandboxes"
    before = set(os.listdir(boxes))
    build = asyncio.create_task(client.build_image(
        name, dockerfile=dockerfile(name, body),
        on_log=lambda line: started.set() if "42-running" in line else None))
    await asyncio.wait_for(started.wait(), 120)
    for _ in range(100):  # forked before the echo, maybe not yet exec'd
        if len(_sleepers(nap)) == 2:
            break
        await asyncio.sleep(0.1)
    assert len(_sleepers(nap)) == 2 and set(os.listdir(boxes)) - before
    build.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await build
    deadline = time.monotonic() + 60
    while _sleepers(nap) or set(os.listdir(boxes)) - before or _scratch_of(name):
        assert time.monotonic() < deadline, (_sleepers(nap), set(os.listdir(boxes)) - before,
                                             _scratch_of(name))
        await asyncio.sleep(0.5)
    with pytest.raises(dsec.ImageNotFound):
        ImageStore().get(name)


async def test_a_build_cut_by_a_server_crash_leaves_no_scratch_image(name: str) -> None:
    """The server is killed (-9) while a build runs a step: once it is back, the build's
    scratch image (its COPYs and RUNs so far, a name that pins their layers against
    collection) is gone too, as its step's sandbox is."""
    own = make_server("--warm-pool", "0").start()
    try:
        started = asyncio.Event()
        async with own.client() as builder:
            build = asyncio.create_task(builder.build_image(
                name, dockerfile=dockerfile(name, "RUN echo $((6*7))-running; sleep 600\n"),
                on_log=lambda line: started.set() if "42-running" in line else None))
            await asyncio.wait_for(started.wait(), 120)
            assert _scratch_of(name)
            own.kill()
            with contextlib.suppress(dsec.DSecError, httpx.HTTPError):
                await build
        own = Server(own.state_dir, own.args).start()
        deadline = time.monotonic() + 60
        while _scratch_of(name):
            assert time.monotonic() < deadline, f"left after the restart: {_scratch_of(name)}"
            await asyncio.sleep(0.5)
    finally:
        stop_server(own)


def _sleepers(nap: str) -> list[int]:
    """Host pids of ``sleep nap``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes() == f"sleep\0{nap}\0".encode():
                found.append(int(pid))
    return found


def _scratch_of(name: str) -> list[str]:
    """The scratch images of the build of ``name`` still in the store."""
    store = ImageStore()
    return [i.name for i in store.list() if "dsec-build-" in i.name and json.loads(
        store._manifest(i.name).read_text())["source"].get("dockerfile_step") == name]


EVIL_NSS = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void take_over(void) {
    int fd = open("/tmp/nss-ran", O_WRONLY | O_CREAT, 0644);
    if (fd >= 0) close(fd);
    _exit(0);  /* whatever the command was, it "succeeded" */
}
"""


async def test_an_image_with_a_user_cannot_run_its_code_in_dsecs_command_wrapper(
        client: dsec.DSecClient, name: str, tmp_path: Path) -> None:
    """A build plants an NSS module and an nsswitch.conf naming it, then sets a USER: the
    commands of its sandboxes go through dsec's ``su`` (static glibc busybox), which must
    not load the image's module (it would end every command with exit 0, ``exit 7``
    included, before it ran)."""
    if subprocess.run(["gcc", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no gcc to make the module with")
    (tmp_path / "evil.c").write_text(EVIL_NSS)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libnss_evil.so.2"),
                    str(tmp_path / "evil.c")], check=True)
    body = ("COPY libnss_evil.so.2 /usr/lib/x86_64-linux-gnu/libnss_evil.so.2\n"
            "RUN printf 'passwd: evil files\\ngroup: evil files\\nshadow: evil files\\n'"
            " > /etc/nsswitch.conf\n"
            "USER nobody\n")
    (tmp_path / "Dockerfile").write_text(dockerfile(name, body))
    built = await client.build_image(name, tmp_path)
    async with await client.create(image=built.image, ttl_s=120) as sb:
        r = await sb.run("id -u; exit 7")
        assert (r.exit_code, r.stdout) == (7, "65534\n"), r
        assert not (await sb.run("test -e /tmp/nss-ran")).exit_code == 0


async def test_files_under_a_lease_cannot_hold_the_commit(
        client: dsec.DSecClient, name: str) -> None:
    """A RUN leaves a process holding write leases on 50 of its files (an open by anyone
    else waits for the holder to let go, 45 s each by default, and the holder is frozen
    during the commit): the commit must not wait, and the server answers meanwhile."""
    holder = ("import fcntl, os, sys, time\n"
              "fds = []\n"
              "for i in range(50):\n"
              "    path = f'/leased-{i}'\n"
              "    open(path, 'w').write('x')\n"
              "    fd = os.open(path, os.O_RDONLY)\n"
              "    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)\n"
              "    fds.append(fd)\n"
              "print('leased', flush=True)\n"
              "time.sleep(3600)\n")
    launcher = ("import subprocess, sys, time\n"
                f"subprocess.Popen([sys.executable, '-c', {holder!r}], start_new_session=True,\n"
                "                 stdout=open('/leases.log', 'w'))\n"
                "for _ in range(100):\n"
                "    if open('/leases.log').read():\n"
                "        break\n"
                "    time.sleep(0.1)\n")
    text = dockerfile(name, f"RUN {json.dumps(['python3', '-c', launcher])}\n", "python-3.11")
    began = time.monotonic()
    build = asyncio.create_task(client.build_image(name, dockerfile=text))
    await asyncio.sleep(1)
    assert (await client.health())  # the server answers while it commits
    try:
        built = await build
        r = await run_in(client, built.image, "cat /leased-0 /leases.log")
        assert r.stdout == "xleased\n"
    except dsec.ImageBuildError as exc:
        assert "leased" in exc.message, exc.message  # refused, typed, naming a file
    assert time.monotonic() - began < 40, "the commit waited for the leases"


async def test_another_projects_build_cannot_be_reached_by_its_digest(
        srv: Server, name: str) -> None:
    """A project builds an image holding a secret; another project's key names it by its
    digest (whole, or the prefix ``sha256:`` that matches every image, whose "ambiguous"
    answer would list the names to narrow it down with): ``image_not_found``, no name of it
    in any answer, never a sandbox of it; a legacy scratch image (``dsec-build-*``, left by
    an older server) neither. Project keys name images by name (their own as well)."""
    projects, keys = (list(column) for column in zip(*await _project_keys(srv, 0)))
    secret = secrets.token_hex(8)
    async with dsec.DSecClient(srv.url, keys[0], autostart=False) as owner, \
            dsec.DSecClient(srv.url, keys[1], autostart=False) as prober:
        built = await owner.build_image(name, dockerfile=dockerfile(
            name, f"RUN echo {secret} > /secret.txt\n"))
        legacy = f"dsec-build-{secrets.token_hex(6)}"
        store = ImageStore()
        for ref in (built.digest, built.digest[:19], "sha256:", legacy):
            if ref == legacy:  # the build's image so far, as an older server named it
                image = store.get(built.image)
                store.save_built(legacy, list(image.layers), image.config,
                                 {"dockerfile_step": name})
            try:
                with pytest.raises((dsec.ImageNotFound, dsec.InvalidRequest)) as caught:
                    sb = await prober.create(image=ref, ttl_s=60)
                    leaked = (await sb.run("cat /secret.txt")).stdout
                    await sb.stop()
                    assert secret not in leaked, f"{ref}: another project read the secret"
            finally:
                if ref == legacy:
                    store.remove(legacy)
            assert built.image not in caught.value.message, (ref, caught.value.message)
            assert ref == legacy or legacy not in caught.value.message, caught.value.message
        r = await run_in(owner, built.image, "cat /secret.txt")  # its own, by its name
        assert r.stdout.strip() == secret
    for ref in ("sha256:", built.digest, built.digest[:19], built.image):  # E2B's fromImage
        status, said = await asyncio.to_thread(_e2b_template_from, srv, keys[1], ref)
        assert status == "error", (ref, said)
        assert ref == built.image or built.image not in said, (ref, said)


def test_an_e2b_upload_of_countless_members_is_refused_before_it_fills_memory(
        srv: Server) -> None:
    """A COPY's upload of 300,000 directory members (one header repeated: 1.5 MiB gzipped,
    150 MiB of tar, no file bytes to count): the build fails naming the member count, and
    the server's memory while it does stays far below the tar it would have re-packed."""
    assert srv.proc is not None
    (_, key), _ = asyncio.run(_project_keys(srv, 0))
    header = tarfile.TarInfo("d")
    header.type, header.mode = tarfile.DIRTYPE, 0o755
    block = header.tobuf(tarfile.GNU_FORMAT) * 10_000
    upload = io.BytesIO()
    with gzip.GzipFile(fileobj=upload, mode="wb") as packed:
        for _ in range(30):
            packed.write(block)
        packed.write(b"\0" * 1024)
    files_hash = secrets.token_hex(32)
    status_file = Path(f"/proc/{srv.proc.pid}/status")

    def peak_mib() -> int:
        fields = dict(line.split(":", 1) for line in status_file.read_text().splitlines())
        return int(fields["VmHWM"].split()[0]) >> 10
    with httpx.Client(base_url=f"{srv.url}/e2b", headers={"X-API-Key": key},
                      timeout=300) as http:
        made = http.post("/v3/templates", json={"name": unique("tpl-bomb")}).json()
        link = http.get(f"/templates/{made['templateID']}/files/{files_hash}").json()
        assert httpx.put(link["url"], content=upload.getvalue(), timeout=120).status_code == 201
        Path(f"/proc/{srv.proc.pid}/clear_refs").write_text("5")  # the peak, from now
        base = peak_mib()
        steps = {"fromImage": "debian-minbase", "steps": [
            {"type": "COPY", "args": [".", "/data/"], "filesHash": files_hash}]}
        assert http.post(f"/v2/templates/{made['templateID']}/builds/{made['buildID']}",
                         json=steps).status_code == 202
        status = build_end(http, made["templateID"], made["buildID"])
    assert status["status"] == "error" and "members" in json.dumps(status), status
    assert peak_mib() - base < 64, f"the server grew by {peak_mib() - base} MiB"


def _e2b_template_from(srv: Server, key: str, image: str) -> tuple[str, str]:
    """A template of ``image`` (no steps) requested with ``key``: how its build ended, and
    all it said (its logs, its failure's reason)."""
    with httpx.Client(base_url=f"{srv.url}/e2b", headers={"X-API-Key": key},
                      timeout=120) as http:
        made = http.post("/v3/templates", json={"name": unique("tpl-probe")}).json()
        answer = http.post(f"/v2/templates/{made['templateID']}/builds/{made['buildID']}",
                           json={"fromImage": image, "steps": []})
        assert answer.status_code == 202, answer.text
        status = build_end(http, made["templateID"], made["buildID"])
        return str(status["status"]), json.dumps(status)


async def test_a_build_of_more_layers_than_a_sandbox_can_stack_fails_typed(
        client: dsec.DSecClient, srv: Server, name: str) -> None:
    """60 steps, each a layer: past what one overlay mount can stack (its options are one
    page), the build fails with a typed error naming why, and names no image."""
    body = "".join(f"RUN echo {i} > /step-{i}\n" for i in range(60))
    boxes = srv.volume / "sandboxes"
    before = set(os.listdir(boxes))
    with pytest.raises(dsec.NotSupported) as caught:  # not a connection cut mid-answer
        await client.build_image(name, dockerfile=dockerfile(name, body))
    assert "layers" in caught.value.message, caught.value
    with pytest.raises(dsec.ImageNotFound):
        ImageStore().get(name)
    assert not _scratch_of(name) and not set(os.listdir(boxes)) - before


@pytest.mark.parametrize("step", ['COPY ["a\\u0000b", "/x"]', "ENV A=x\x00y\nRUN true",
                                  "WORKDIR /a\x00b", 'RUN ["/bin/echo", "a\\u0000b"]',
                                  "USER nobody\x00"])
async def test_nul_bytes_in_a_dockerfile_fail_typed(
        client: dsec.DSecClient, name: str, step: str) -> None:
    """A NUL byte where a path, a variable or an argument is read: a typed error, the
    build's answer whole (never a connection cut mid-answer), nothing named."""
    with pytest.raises(dsec.DSecError) as caught:
        await client.build_image(name, b"", dockerfile=dockerfile(name, step + "\n"))
    assert not isinstance(caught.value, dsec.ServerUnavailable), caught.value
    with pytest.raises(dsec.ImageNotFound):
        ImageStore().get(name)


async def test_run_flags_are_honoured_or_refused_never_ignored(
        client: dsec.DSecClient, name: str, dest: Destination) -> None:
    """``RUN --network=none`` in a build given an egress allow runs that step offline (it
    ran online: the flag was dropped without a word); flags dsec does not do (a secret or
    bind mount, another network, ``--security=insecure``) are refused before anything runs."""
    probe = (f"if timeout 5 bash -c 'exec 3<>/dev/tcp/{dest.address}/{DEST_PORTS[0]}' "
             "2>/dev/null; then echo online; else echo offline; fi")
    allow = {"allow": [f"{dest.address}:{DEST_PORTS[0]}"]}
    text = dockerfile(name, f"RUN --network=none {probe} > /none\nRUN {probe} > /default\n")
    built = await client.build_image(name, dockerfile=text, network=allow)
    r = await run_in(client, built.image, "cat /none /default")
    assert r.stdout.split() == ["offline", "online"]
    for flag in ("--network=host", "--mount=type=secret,id=x", "--mount=type=bind,target=/x",
                 "--security=insecure", "--frobnicate=1"):
        with pytest.raises((dsec.NotSupported, dsec.InvalidRequest)):
            await client.build_image(name + "-refused", dockerfile=dockerfile(
                name, f"RUN {flag} true\n"), network=allow)


async def test_a_flood_of_dropped_fifos_is_not_a_flood_of_the_servers_log(
        client: dsec.DSecClient, srv: Server, name: str) -> None:
    """A RUN leaves 50,000 fifos (nothing of them reaches the layer): the server's log, a
    host file outside every quota, says so in a few lines, not one line each."""
    log = LOG_DIR / f"{srv.state_dir.name}.log"
    before = log.stat().st_size
    body = "RUN mkdir /fifos && cd /fifos && seq 1 50000 | xargs mkfifo\n"
    lines: list[str] = []
    built = await client.build_image(name, dockerfile=dockerfile(name, body), on_log=lines.append)
    assert built.steps_run == 1
    with log.open("rb") as f:
        f.seek(before)
        grown = f.read()
    assert grown.count(b"\n") < 100, f"{grown.count(chr(10).encode())} lines of log"
    assert len([line for line in lines if "dropped" in line]) < 10
    r = await run_in(client, built.image, "ls /fifos | wc -l")
    assert r.stdout.strip() == "0"


@pytest.mark.parametrize("tree", ["deep", "long"])
async def test_a_tree_a_layer_cannot_hold_fails_typed_and_leaks_nothing(
        client: dsec.DSecClient, name: str, tree: str) -> None:
    """300 directories deep, or 40 deep of 200-character names (paths past PATH_MAX on the
    host): the build fails typed, and leaves no image, step sandbox, scratch image or
    scratch layer directory behind."""
    part = "d" if tree == "deep" else "n" * 200
    depth = 300 if tree == "deep" else 40
    body = (f"RUN mkdir x && i=0; while [ $i -lt {depth} ]; do mkdir y && mv x y/{part} && "
            f"mv y x || exit 1; i=$((i+1)); done; echo bottom > x/f\n")  # never a long path
    tmp = ImageStore().root / "tmp"
    before = set(os.listdir(tmp))
    with pytest.raises(dsec.ImageBuildError) as caught:
        await client.build_image(name, dockerfile=dockerfile(name, body))
    assert "layer" in caught.value.message, caught.value.message[-400:]
    with pytest.raises(dsec.ImageNotFound):
        ImageStore().get(name)
    assert not _scratch_of(name)
    assert not [s for s in await client.list() if s.labels.get("dsec.build") == name]
    deadline = time.monotonic() + 30
    while (new := [n for n in set(os.listdir(tmp)) - before if (tmp / n / "rootfs" / part).exists()]):
        assert time.monotonic() < deadline, f"scratch left in the store: {new}"
        await asyncio.sleep(0.5)


async def test_a_racer_left_running_by_a_run_commits_a_frozen_layer(
        client: dsec.DSecClient, name: str) -> None:
    """A RUN leaves a process swapping a file for a link to the host's files and growing
    another, as fast as it can: the layer is one frozen instant of the tree (the link kept
    as a link, never followed on the host), and the next sandbox runs none of it."""
    racer = ("while :; do echo mine > /swap.tmp && mv /swap.tmp /swap; ln -sfn /etc/shadow /swap;"
             " ln -sfn /proc/1/root /swap; head -c 65536 /dev/zero >> /grow; done")
    body = (f"RUN setsid sh -c '{racer}' </dev/null >/dev/null 2>&1 & sleep 1; echo started\n")
    built = await client.build_image(name, dockerfile=dockerfile(name, body), disk_mb=1024)
    assert built.steps_run == 1
    r = await run_in(client, built.image, "if [ -L /swap ]; then readlink /swap; "
                                          "else cat /swap; fi; grep -l 'swap[.]tmp' "
                                          "/proc/[0-9]*/cmdline | wc -l")
    first = r.stdout.splitlines()[0]
    assert first in ("mine", "/etc/shadow", "/proc/1/root"), r.stdout
    assert r.stdout.splitlines()[1] == "0"  # no racer in a sandbox of the image


def test_e2b_uploads_waiting_for_a_build_are_bounded_on_the_host(srv: Server) -> None:
    """A template that never builds takes uploads for any files hash it names: what a
    project can leave on the host's disk that way is bounded (1 GiB over its templates,
    refused 413 past it, nothing stored), and a deleted template's uploads go with it, so
    deleting and asking again frees nothing but what was deleted."""
    (_, key), _ = asyncio.run(_project_keys(srv, 0))
    chunk = os.urandom(16 << 20)
    uploads = srv.state_dir / "e2b-uploads"
    with httpx.Client(base_url=f"{srv.url}/e2b", headers={"X-API-Key": key},
                      timeout=120) as http, httpx.Client(timeout=120) as plain:

        def fill(template: str, count: int) -> tuple[int, int]:
            """PUTs of ``chunk`` under new hashes: (bytes taken, the status that stopped)."""
            taken, status = 0, 201
            for _ in range(count):
                link = http.get(f"/templates/{template}/files/{secrets.token_hex(32)}")
                assert link.status_code == 201, link.text
                status = plain.put(link.json()["url"], content=chunk).status_code
                if status != 201:
                    break
                taken += len(chunk)
            return taken, status

        first, second = (http.post("/v3/templates", json={"name": unique("tpl-fill")}).json()
                         ["templateID"] for _ in range(2))
        assert fill(first, 32) == (512 << 20, 201)
        taken, status = fill(second, 48)  # 768 MiB asked for, 512 MiB left to the project
        assert (taken, status) == (512 << 20, 413)
        on_disk = sum(f.stat().st_size for f in uploads.glob("*/*")
                      if f.parent.name in (first, second))
        assert on_disk == 1 << 30
        assert http.delete(f"/templates/{first}").status_code == 204
        assert not (uploads / first).exists()  # its uploads went with it
        assert fill(second, 1) == (16 << 20, 201)  # the room it held is free again
