"""Dockerfile builds (edge/dockerbuild.py): each RUN, COPY and WORKDIR step in a real dsec
container sandbox, its writable layer taken as a layer; the built image run by a real server.

Builds run through the command line (``dsec image build -f``, its own builder edge on a
private state dir) or in this process (``builder_edge``) where a test reads a typed error.
Images go to the shared images cache under test-unique names, removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec
from conftest import DEST_PORTS, TEST_ROOT, Server
from dsec.config import Settings, install
from dsec.edge.assemble import builder_edge
from dsec.edge.dockerbuild import BuildOptions, DockerfileBuild, build_dockerfile
from dsec.images.mount import LayerMounter
from dsec.images.store import ImageStore
from dsec.network.testbed import Destination
from dsec.protocol.errors import ImageBuildError, InvalidRequest, NotSupported
from dsec.protocol.models import CreateRequest, ExecRequest
from test_image_pull import Registry, _archive
from test_image_pull import no_credentials as no_registry_credentials  # noqa: F401 (a fixture)
from test_image_pull import registry as pull_registry  # noqa: F401 (a fixture)
from test_images import _busybox_layers

pytestmark = pytest.mark.usefixtures("images")


@pytest.fixture(scope="module")
def build_state() -> Iterator[Path]:
    state = TEST_ROOT / f"build-{secrets.token_hex(3)}"
    state.mkdir(parents=True)
    yield state
    LayerMounter(state / "layers").unmount_all()
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def name(images: ImageStore) -> Iterator[str]:
    image = f"test-dockerfile-{secrets.token_hex(4)}"
    yield image
    try:
        images.remove(image)
    except dsec.ImageNotFound:
        pass


# Every Dockerfile here declares ``ARG NONCE`` after FROM and each build gives it the image's
# test-unique name: the steps' cache keys are this test's own, not hits of an earlier run
# (the images cache is shared and keeps layers).
def cli_build(state: Path, context: Path, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsec", "image", "build", "-f", str(context / "Dockerfile"),
         str(context), "--name", name, "--build-arg", f"NONCE={name}", *args],
        env={**os.environ, "DSEC_STATE_DIR": str(state), "COLUMNS": "400"},
        capture_output=True, text=True, timeout=900)


async def build_here(state: Path, context: Path, name: str, dockerfile: str,
                     options: BuildOptions | None = None) -> DockerfileBuild:
    settings = Settings.load(state_dir=state)
    first, _, rest = dockerfile.partition("\n")
    dockerfile = f"{first}\nARG NONCE\n{rest}"
    options = options or BuildOptions()
    options.build_args["NONCE"] = name
    (context / "Dockerfile").write_text(dockerfile)
    install(settings)  # as the CLI's build does; this test process's other tests read the
    try:               # environment's settings, so it is given back after
        async with builder_edge(settings) as edge:
            return await build_dockerfile(edge, dockerfile, context, name, options)
    finally:
        install(None)


async def run_in(server: Server, image: str, command: str) -> dsec.ExecResult:
    async with server.client() as client:
        async with await client.create(image=image, ttl_s=120) as sb:
            return await sb.run(command, timeout_s=60)


PROJECT = """\
FROM debian-minbase
ARG NONCE
ARG GREETING=hi
ENV APP_HOME=/srv/app LANGUAGE_NAME=python
WORKDIR $APP_HOME
COPY src/ ./src/
COPY ["hello.txt", "data/"]
RUN echo "$GREETING $(cat data/hello.txt) $(od -An -N8 -tx8 /dev/urandom)" > stamp.txt \\
 && useradd -m builder && chown builder /srv/app
USER builder
RUN id -un > whoami.txt && echo "as $(id -un) in $(pwd)"
LABEL org.example.kind=test
CMD ["python3", "-m", "app"]
"""


async def test_build_runs_copies_and_is_honoured_at_run_time_then_cached(
        build_state: Path, tmp_path: Path, name: str, server: Server) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "app.py").write_text("print('app')\n")
    (tmp_path / "hello.txt").write_text("hello\n")
    (tmp_path / "Dockerfile").write_text(PROJECT)
    first = cli_build(build_state, tmp_path, name)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "5 steps run, 0 cached" in first.stdout + first.stderr  # WORKDIR, 2 COPY, 2 RUN
    assert "as builder in /srv/app" in first.stdout + first.stderr  # a RUN's output, streamed

    r = await run_in(server, name, "pwd; id -un; echo $APP_HOME $LANGUAGE_NAME; cat whoami.txt; "
                                   "cat src/app.py data/hello.txt; cat stamp.txt; "
                                   "touch mine && echo writable")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:6] == ["/srv/app", "builder", "/srv/app python", "builder", "print('app')", "hello"]
    assert re.fullmatch(r"hi hello +[0-9a-f]{16}", lines[6])
    assert lines[7] == "writable"  # the USER owns its WORKDIR (chown in a RUN)
    stamp = lines[6]
    image = ImageStore().get(name)
    assert image.config.user == "builder" and image.config.working_dir == "/srv/app"
    assert image.config.cmd == ("python3", "-m", "app")
    assert "org.example.kind=test" in image.config.labels

    again = cli_build(build_state, tmp_path, name)  # nothing changed: every step a cache hit
    assert again.returncode == 0, again.stdout + again.stderr
    assert "0 steps run, 5 cached" in again.stdout + again.stderr
    assert "as builder" not in again.stdout  # no RUN ran
    assert ImageStore().get(name).digest == image.digest
    r = await run_in(server, name, "cat stamp.txt")
    assert r.stdout.strip() == stamp  # the random value of the first run: not run again

    (tmp_path / "hello.txt").write_text("changed\n")  # a COPY's content is in its key
    changed = cli_build(build_state, tmp_path, name)
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert "3 steps run, 2 cached" in changed.stdout + changed.stderr  # WORKDIR and the first COPY hit


async def test_failing_run_reports_exit_code_and_output(build_state: Path, tmp_path: Path,
                                                       name: str) -> None:
    dockerfile = ("FROM debian-minbase\nRUN echo first-line; echo on-stderr >&2; "
                  "printf 'last-words\\033]52;c;aGk=\\a\\n'; exit 3\n")
    with pytest.raises(ImageBuildError) as caught:
        await build_here(build_state, tmp_path, name, dockerfile)
    assert caught.value.details["exit_code"] == 3
    assert "last-words" in caught.value.details["output"]
    assert "on-stderr" in caught.value.details["output"]
    assert "line 3" in caught.value.message
    assert "\x1b" in caught.value.details["output"]  # the data as it was
    assert "\x1b" not in caught.value.message  # but no terminal escapes in what is printed
    with pytest.raises(dsec.ImageNotFound):
        ImageStore().get(name)  # nothing named
    failed = cli_build(build_state, tmp_path, name)
    assert failed.returncode == 1
    assert "image_build_failed" in failed.stderr and "exited with 3" in failed.stderr + failed.stderr


async def test_run_has_no_network_unless_the_build_allows_it(
        build_state: Path, tmp_path: Path, name: str, dest: Destination) -> None:
    connect = (f"FROM debian-minbase\nRUN timeout 20 bash -c 'exec 3<>/dev/tcp/{dest.address}/"
               f"{DEST_PORTS[0]} && head -c 64 <&3' > greeting.txt\n")
    with pytest.raises(ImageBuildError) as caught:
        await build_here(build_state, tmp_path, name, connect)
    assert ("unreachable" in caught.value.details["output"]
            or "No route" in caught.value.details["output"])
    allowed = BuildOptions(network=dsec.NetworkPolicy(allow=[f"{dest.address}:{DEST_PORTS[0]}"]))
    built = await build_here(build_state, tmp_path, name, connect, allowed)
    assert built.ran == 1
    check = await build_here(build_state, tmp_path, name + "-2",
                             f"FROM {name}\nRUN grep -q hello-{DEST_PORTS[0]} greeting.txt\n")
    ImageStore().remove(check.image.name)


HOSTILE = """\
FROM debian-minbase
RUN ln -s /etc/shadow /hostshadow && ln -s {target} /hostdir \\
 && mkdir -p /evil && ln -s {target} /evil/into && echo x > /.wh.etc && echo y > /etc/.wh.passwd \\
 && mkfifo /fifo && rm /etc/issue && dd if=/dev/zero of=/big bs=1M count=40 status=none \\
 && (echo escape > /.dsec/escape 2>/dev/null || true) && (mknod /dev-null c 1 3 2>/dev/null || true) \
 && rm -rf /etc/apt && mkdir /etc/apt && echo new > /etc/apt/only
"""


async def test_hostile_run_leaves_a_safe_layer_and_host(build_state: Path, tmp_path: Path,
                                                       name: str, server: Server) -> None:
    target = tmp_path / "host-target"  # what a followed link would write into
    built = await build_here(build_state, tmp_path, name, HOSTILE.format(target=target))
    assert built.ran == 1
    assert not target.exists()  # never followed on the host
    r = await run_in(server, name, "readlink /hostshadow; test -e /etc/passwd && echo passwd; "
                                   "test -d /etc && echo etc; cat /.wh.etc; test -e /fifo || "
                                   "echo nofifo; test -e /etc/issue || echo whiteout; "
                                   "stat -c %s /big; test -e /dev-null || echo nodev; ls /etc/apt")
    assert r.stdout.splitlines() == [
        "/etc/shadow", "passwd", "etc", "x", "nofifo", "whiteout", str(40 << 20), "nodev",
        "only"]  # a directory removed and made again hides the lower one (opaque)
    # a file named like a whiteout stays a file; a fifo and devices never reach a layer


async def test_a_layer_bigger_than_the_steps_disk_is_refused(build_state: Path, tmp_path: Path,
                                                             name: str) -> None:
    sparse = "FROM debian-minbase\nRUN truncate -s 64G /sparse\n"  # tiny on disk, huge copied
    with pytest.raises(ImageBuildError, match="more than its disk"):
        await build_here(build_state, tmp_path, name, sparse, BuildOptions(disk_mb=256))


@pytest.mark.parametrize("copy", ["COPY ../outside /x", "COPY link-out /x", "COPY tree /x",
                                  "ADD https://example.invalid/x /x", "ADD pkg.tar.gz /x"])
async def test_copy_refuses_escapes_from_the_context(build_state: Path, tmp_path: Path,
                                                     name: str, copy: str) -> None:
    context = tmp_path / "ctx"
    (context / "tree").mkdir(parents=True)
    (tmp_path / "outside").write_text("secret\n")
    (context / "link-out").symlink_to(tmp_path / "outside")
    (context / "tree" / "inner-link").symlink_to("/etc/passwd")
    (context / "pkg.tar.gz").write_bytes(b"")
    error = NotSupported if copy.startswith("ADD") else InvalidRequest
    with pytest.raises(error):
        await build_here(build_state, context, name, f"FROM debian-minbase\n{copy}\n")
    with pytest.raises(dsec.ImageNotFound):
        ImageStore().get(name)


PYTHON_PROJECT = """\
FROM python-3.11
ARG NONCE
ENV PIP_RETRIES=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
WORKDIR /srv/project
COPY host-ca.pem /etc/pip-ca.pem
ENV PIP_CERT=/etc/pip-ca.pem
COPY requirements.txt .
RUN python3 -m venv /opt/venv && pip install --no-cache-dir --disable-pip-version-check \\
    -r requirements.txt
COPY app.py .
CMD ["python", "app.py"]
"""


async def test_python_project_pip_installs_through_the_pypi_service(
        build_state: Path, tmp_path: Path, name: str, server: Server) -> None:
    # The host's trust store, as a user behind a TLS-inspecting proxy would give pip (as
    # on these machines); elsewhere it holds the public CAs pip would use anyway.
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", tmp_path / "host-ca.pem")
    (tmp_path / "requirements.txt").write_text("six==1.16.0\n")
    (tmp_path / "app.py").write_text("import six\nprint('six', six.__version__)\n")
    (tmp_path / "Dockerfile").write_text(PYTHON_PROJECT)
    offline = cli_build(build_state, tmp_path, name)  # no network: pip cannot reach PyPI
    assert offline.returncode == 1
    assert "image_build_failed" in offline.stderr
    built = cli_build(build_state, tmp_path, name, "--allow", "pypi")
    assert built.returncode == 0, built.stdout + built.stderr
    assert "Successfully installed six-1.16.0" in built.stderr
    r = await run_in(server, name, "python app.py")
    assert (r.exit_code, r.stdout) == (0, "six 1.16.0\n"), r.stderr


async def test_user_before_the_first_run_applies_to_it(build_state: Path, tmp_path: Path,
                                                      name: str, server: Server) -> None:
    """The first RUN's sandbox has the parent's very layers (the same image version as
    debian-minbase) but this build's USER and WORKDIR: the create's config counts."""
    built = await build_here(build_state, tmp_path, name, "FROM debian-minbase\nUSER nobody\n"
                             "RUN id -un > /tmp/who; pwd >> /tmp/who\n")
    assert built.ran == 1
    r = await run_in(server, name, "cat /tmp/who; id -un")
    assert r.stdout.splitlines() == ["nobody", "/work", "nobody"]
    async with server.client() as client, await client.create(image=name, ttl_s=120) as sb:
        # files go in and out as root, as the file API does: commands run as the USER
        (tmp_path / "up").mkdir()
        (tmp_path / "up" / "in.txt").write_text("in\n")
        await sb.upload(tmp_path / "up", "/opt/uploaded")  # /opt is root's
        r = await sb.run("stat -c %U /opt/uploaded/in.txt; id -un")
        assert r.stdout.split() == ["root", "nobody"]
        await sb.download("/opt/uploaded", tmp_path / "down")
        assert (tmp_path / "down" / "in.txt").read_text() == "in\n"


@pytest.mark.usefixtures("no_registry_credentials")
async def test_from_a_registry_reference_pulls_it_and_builds_on_it(
        build_state: Path, tmp_path: Path, name: str,
        pull_registry: Registry) -> None:  # noqa: F811 (the fixture, by its name)
    """FROM a reference not in the store: pulled (from a loopback registry), then built on."""
    repo = f"tests/dockerfile-base-{secrets.token_hex(3)}"
    pull_registry.push(_archive(tmp_path, "busybox", _busybox_layers()), f"{repo}:1")
    ref = f"{pull_registry.host}/{repo}:1"
    store = ImageStore()
    try:
        built = await build_here(build_state, tmp_path, name,
                                 f"FROM {ref}\nRUN echo built > /data/new.txt && rm /etc/keep.txt\n")
        base = store.get(ref)
        assert built.ran == 1
        assert built.image.layers[:-1] == base.layers  # the pulled layers, then the RUN's
        assert built.image.config.env == base.config.env  # the base's config carried on
        settings = Settings.load(state_dir=build_state)
        async with builder_edge(settings) as edge:
            info = await edge.create(CreateRequest(image=name, ttl_s=60))
            r = await edge.run(info.id, ExecRequest(
                command="cat /data/new.txt; test -e /etc/keep.txt || echo whiteout"))
        assert r.stdout_bytes.decode().split() == ["built", "whiteout"]
    finally:
        with contextlib.suppress(dsec.ImageNotFound):
            store.remove(ref)
