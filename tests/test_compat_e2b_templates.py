"""E2B templates: the real ``e2b`` SDK's ``Template`` (in its compat virtualenv) drives a real
dsec server, building from images pushed to a real OCI registry on loopback (Debian's
``docker-registry``, the fixture of test_image_pull.py): exists, build (logs, env, workdir),
create from the template, list, delete; RUN and COPY steps (files uploaded by the SDK) built
through the server's Dockerfile build; failing steps, hostile uploads and bad references fail
with the SDK's own exceptions and leave nothing ready; another project's key
sees, uses and deletes nothing; hostile names are refused with nothing stored."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Server, make_tcp_server, stop_server
from support.compat_venvs import compat_python
from test_compat_e2b import E2B_VERSIONS, _project_keys, e2b_env
from test_image_pull import Registry, pytestmark, registry  # noqa: F401 (the module's fixture)
from test_images import _busybox_layers, _layer_tar, make_oci_archive
from test_integrations import HARBOR, PYENV
from test_projects import unique

E2B_VERSION = E2B_VERSIONS[-1]  # the newest of the matrix; the main cases run in each version
DRIVER = Path(__file__).parent / "support" / "compat_e2b_template_driver.py"
# E2B runs commands with /bin/bash -l -c: the test image's bash is busybox's sh
BASH = b'#!/bin/busybox sh\nexec /bin/busybox sh "$@"\n'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    auth = tmp_path_factory.mktemp("server-auth") / "auth.json"
    auth.write_text("{}")
    os.environ["DSEC_REGISTRY_AUTH"] = str(auth)  # the server inherits it
    srv = make_tcp_server("--pull", "missing", "--warm-pool", "0", "--image-store",
                          str(tmp_path_factory.mktemp("template-store"))).start()
    del os.environ["DSEC_REGISTRY_AUTH"]
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory, registry: Registry) -> str:  # noqa: F811
    """A busybox image (with a bash for E2B's commands) in the registry."""
    layers = [*_busybox_layers(), _layer_tar([("bin/bash", BASH, 0o755)])]
    archive = make_oci_archive(tmp_path_factory.mktemp("tpl") / "box.tar", layers)
    for tag in ["1", *E2B_VERSIONS]:  # one reference per version: each main case pulls its own
        registry.push(archive, f"tests/tpl-box:{tag}")
    return f"{registry.host}/tests/tpl-box:1"


def drive(server: Server, steps: list[list[Any]], key: str | None = None,
          version: str = E2B_VERSION) -> list[Any]:
    env = e2b_env(server)
    if key:
        env["E2B_API_KEY"] = key
    proc = subprocess.run([str(compat_python("e2b", version)), str(DRIVER), json.dumps(steps)],
                          env=env, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    results: list[Any] = json.loads(proc.stdout)
    return results


@pytest.mark.parametrize("version", E2B_VERSIONS)
def test_build_from_an_image_create_list_delete(server: Server, image: str, version: str) -> None:
    name, ref = unique("tpl"), image.rsplit(":", 1)[0] + f":{version}"
    before, no_tags, built, after, tagged, ran, listed, status, async_built = drive(server, [
        ["exists", name], ["tags", name], ["build", name + ":v1", ref], ["exists", name],
        ["tags", name],
        ["run", name, "echo $GREETING $TPL_GREETING; pwd; cat /etc/keep.txt; ls /data"],
        ["list"], ["background", name + "-bg", image], ["async_build", name + "-async", image]],
        version=version)
    assert before == [False, False]
    assert no_tags["raised"] == "TemplateException" and "not found" in no_tags["message"]
    assert "raised" not in built, built
    assert any(f"pulled {ref}" in line for line in built["logs"]), built["logs"]
    assert any("layer" in line for line in built["logs"])  # the pull's progress lines
    assert after == [True, True] and tagged == ["v1"]
    # the image's env and files (whiteouts kept), the template's env and WORKDIR
    assert ran == {"stdout": "hi from-template\n/data\nkept\nnew.txt\n", "exit_code": 0}
    mine = [t for t in listed["templates"] if t["aliases"] == [name]]
    assert mine == [{"aliases": [name], "template_id": built["template_id"], "status": "ready"}]
    assert status["status"] in ("building", "ready")  # build_in_background returns at once
    assert async_built == {"exists": [False, True], "status": "ready"}  # AsyncTemplate (harbor's)

    deleted, gone, again, run_gone = drive(server, [
        ["delete", built["template_id"]], ["exists", name], ["delete", name], ["run", name, "true"]],
        version=version)
    assert deleted == 204 and gone == [False, False] and again == 404
    assert run_gone["raised"] in ("NotFoundException", "SandboxException"), run_gone


def test_a_dockerfile_of_metadata_steps_and_a_template_of_a_template_build(
        server: Server, image: str) -> None:
    name = unique("tpl-df")
    built, ran, child, child_ran = drive(server, [
        ["build", name, image, "dockerfile"], ["run", name, "echo $TPL_GREETING; pwd"],
        ["build", name + "-child", name, "template"],
        ["run", name + "-child", "echo $TPL_GREETING; pwd"]])
    assert "raised" not in built, built
    assert ran["stdout"] == "dockerfile\n/etc\n"
    assert "raised" not in child, child
    assert child_ran["stdout"] == "dockerfile\n/etc\n"  # from_template: its env and workdir


@pytest.mark.parametrize("version", E2B_VERSIONS)
def test_run_and_copy_steps_build_an_image_through_the_dockerfile_build(
        server: Server, image: str, version: str) -> None:
    """RUN and COPY (the SDK uploads the files to the link the server answers, then the build
    runs through the server's one Dockerfile builder); a failing RUN fails the build with its
    output and leaves nothing ready."""
    name = unique("tpl-steps")
    built, ran, failed, exists, listed = drive(server, [
        ["build", name, image, "steps"],
        ["run", name, "cat /data/x; cat /data/size; pwd; echo $TPL_GREETING"],
        ["build", name + "-bad", image, "failing"], ["exists", name + "-bad"], ["list"]],
        version=version)
    assert "raised" not in built, built
    assert any("step-output" in line for line in built["logs"]), built["logs"]
    assert any("RUN" in line for line in built["logs"])  # each step's progress
    size = DRIVER.stat().st_size
    assert ran == {"stdout": f"built-from-template\n{size}\n/data\nfrom-template\n",
                   "exit_code": 0}, ran
    assert failed["raised"] == "BuildException", failed
    assert "exited with 5" in failed["message"] and "about-to-fail" in failed["message"]
    assert "\x1b" not in failed["message"]
    assert exists == [False, False]
    assert [t["status"] for t in listed["templates"] if t["aliases"] == [name + "-bad"]] == ["error"]


def test_hostile_uploads_are_refused(server: Server, image: str) -> None:
    """An upload link is the build's own: no token, a forged one, one for another hash or
    another project's key get nothing stored; a tar with escapes fails the build, nothing
    ready, nothing written outside."""
    (_, mine), (_, theirs) = asyncio.run(_project_keys(server, 0))
    files_hash = "a" * 64
    with httpx.Client(base_url=f"{server.url}/e2b", headers={"X-API-Key": mine}) as http:
        made = http.post("/v3/templates", json={"name": unique("tpl-up")}).json()
        template = made["templateID"]
        answer = http.get(f"/templates/{template}/files/{files_hash}")
        assert answer.status_code == 201, answer.text  # E2B's
        link = answer.json()
        assert link["present"] is False and link["url"].startswith(f"{server.url}/e2b/templates/")
        assert http.get(f"/templates/{template}/files/not-a-hash").status_code == 400
        with httpx.Client(base_url=f"{server.url}/e2b", headers={"X-API-Key": theirs}) as them:
            assert them.get(f"/templates/{template}/files/{files_hash}").status_code == 404
        token = link["url"].partition("token=")[2]
        plain = httpx.Client()  # the SDK PUTs without its key
        for url in (link["url"].partition("?")[0], link["url"] + "0",
                    link["url"].replace(files_hash, "b" * 64),
                    link["url"].replace(token, "default." + token.partition(".")[2])):
            assert plain.put(url, content=b"x").status_code == 403, url
        assert http.get(f"/templates/{template}/files/{files_hash}").json()["present"] is False
        evil = io.BytesIO()
        with tarfile.open(fileobj=evil, mode="w") as tar:
            info = tarfile.TarInfo("../../escaped-upload.txt")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"x\n"))
        assert plain.put(link["url"], content=evil.getvalue()).status_code == 201
        assert http.get(f"/templates/{template}/files/{files_hash}").json()["present"] is True
        steps = {"fromImage": image.rsplit(":", 1)[0] + ":1", "steps": [
            {"type": "COPY", "args": [".", "/data/"], "filesHash": files_hash}]}
        assert http.post(f"/v2/templates/{template}/builds/{made['buildID']}",
                         json=steps).status_code == 202
        status = build_end(http, template, made["buildID"])
        assert status["status"] == "error" and "'..'" in status["reason"]["message"], status
        with httpx.Client(base_url=f"{server.url}/e2b", headers={"X-API-Key": theirs}) as them:
            status_url = f"/templates/{template}/builds/{made['buildID']}/status"
            assert them.get(status_url).status_code == 404  # the build's logs are mine
        assert not Path("/escaped-upload.txt").exists()
        assert not (server.state_dir / "e2b-uploads" / template).exists()  # gone with the build
        plain.close()


def build_end(http: httpx.Client, template: str, build: str) -> dict[str, Any]:
    """The status of an E2B template build once it is neither waiting nor building."""
    status: dict[str, Any] = {"status": "building"}
    while status["status"] in ("waiting", "building"):
        time.sleep(0.2)
        status = http.get(f"/templates/{template}/builds/{build}/status").json()
    return status


def test_a_bad_reference_fails_the_build_and_leaves_nothing_ready(server: Server,
                                                                  registry: Registry) -> None:  # noqa: F811
    name = unique("tpl-bad")
    missing, invalid, exists, listed = drive(server, [
        ["build", name, f"{registry.host}/tests/no-such-image:1"],
        ["build", name, "UPPER//bad ref"], ["exists", name], ["list"]])
    assert missing["raised"] == "BuildException", missing
    assert "no-such-image" in missing["message"]
    assert invalid["raised"] == "BuildException", invalid
    assert exists == [False, False]
    assert [t["status"] for t in listed["templates"] if t["aliases"] == [name]] == ["error"]


def test_another_projects_key_cannot_see_use_or_delete_a_template(server: Server,
                                                                   image: str) -> None:
    (_, mine), (_, theirs) = asyncio.run(_project_keys(server, 0))
    name = unique("tpl-own")
    built, = drive(server, [["build", name, image]], key=mine)
    assert "raised" not in built, built
    exists, listed, deleted, by_alias, ran = drive(server, [
        ["exists", name], ["list"], ["delete", built["template_id"]], ["delete", name],
        ["run", name, "true"]], key=theirs)
    assert exists == [False, False]
    assert listed["templates"] == []
    assert deleted == 404 and by_alias == 404
    assert "raised" in ran  # the name is no template of theirs, nor a dsec image
    still, = drive(server, [["exists", name]], key=mine)
    assert still == [True, True]
    # the same alias in their project is theirs alone
    theirs_built, = drive(server, [["build", name, image]], key=theirs)
    assert theirs_built["template_id"] != built["template_id"]


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", "x;rm -rf /", "UPPER", "a" * 64,
                                  "ok:bad tag", "%2e%2e", "sn-looks-like-a-snapshot"])
def test_hostile_template_names_are_refused_and_nothing_is_stored(server: Server,
                                                                   name: str) -> None:
    with httpx.Client(base_url=f"{server.url}/e2b", headers={"X-API-Key": server.key}) as http:
        answer = http.post("/v3/templates", json={"name": name})
        assert answer.status_code == 400, answer.text
        assert answer.json()["code"] == 400
        assert all(name.partition(":")[0] not in t["aliases"] for t in http.get("/templates").json())
        for bad in ({"name": 5}, {"tags": ["a b"], "name": "fine"}, {"name": "x", "cpuCount": 0}):
            assert http.post("/v3/templates", json=bad).status_code == 400
        assert http.get("/templates/aliases/..%2f..%2fetc").status_code == 404


def test_hostile_build_bodies_are_typed_4xx_and_leave_nothing_ready(server: Server) -> None:
    surrogate = '"\\ud800"'
    with httpx.Client(base_url=f"{server.url}/e2b",
                      headers={"X-API-Key": server.key, "Content-Type": "application/json"}) as http:
        for body in (f'{{"name": {surrogate}}}', '{"name": "x", "cpuCount": Infinity}',
                     '{"name": "x", "memoryMB": NaN}', '["name"]', "not json",
                     '{"name": "x", "cpuCount": true}'):
            answer = http.post("/v3/templates", content=body.encode())
            assert answer.status_code == 400 and answer.json()["code"] == 400, (body, answer.text)
        names = {unique("tpl-h"): steps for steps in (
            "{}", '{"fromImage": "x", "steps": "RUN"}',
            '{"fromImage": "x", "steps": [{"type": "RUN", "args": []}]}',
            '{"fromImage": "x", "steps": [{"type": "COPY", "args": ["a", "/b"]}]}',
            '{"fromImage": "x", "steps": [{"type": "ENV", "args": ["A"]}]}',
            '{"fromImage": "x", "steps": [{"type": "WORKDIR", "args": [1]}]}',
            '{"fromImage": "x", "steps": [{"type": "SHELL", "args": []}]}',
            '{"fromImage": "x", "fromTemplate": "y"}',
            '{"fromImage": "x", "fromImageRegistry": {"type": "registry"}}',
            '{"fromImage": "x", "steps": [' + ",".join(['{"type": "USER", "args": ["u"]}'] * 600) + "]}",
            f'{{"fromImage": {surrogate}}}')}
        for name, steps in names.items():
            made = http.post("/v3/templates", json={"name": name}).json()
            url = f"/v2/templates/{made['templateID']}/builds/{made['buildID']}"
            assert http.post(f"/v2/templates/{made['templateID']}/builds/other",
                             content=b'{"fromImage": "x"}').status_code == 404
            answer = http.post(url, content=steps.encode())
            assert answer.status_code == 400 and answer.json()["code"] == 400, (steps, answer.text)
            status = http.get(f"/templates/{made['templateID']}/builds/{made['buildID']}/status")
            unread = surrogate in steps  # refused as it is read: the build still waits for steps
            assert status.json()["status"] == ("waiting" if unread else "error")
            assert ["x"] not in [t["aliases"] for t in http.get("/templates").json()]  # refused
            # a failed build is not started again; one that never got its steps still can be
            retry = http.post(url, content=b'{"fromImage": "no-such-dsec-image"}')
            assert retry.status_code == (202 if unread else 409)
            assert http.get(f"/templates/{made['templateID']}/builds/{made['buildID']}/status",
                            params={"logsOffset": "-1"}).status_code == 400
            assert http.get(f"/templates/aliases/{name}").status_code == 404


def test_harbors_e2b_environment_builds_its_template_and_runs(server: Server,
                                                               tmp_path: Path) -> None:
    """harbor's own E2B environment, unmodified: its template from a task's Dockerfile (RUN,
    COPY, ENV, WORKDIR, and harbor's own RUN steps as root), built through dsec's Dockerfile
    build, then a sandbox of it running a command; then harbor's Trial (oracle agent,
    verifier) on a task whose environment is a Dockerfile with a RUN step: rewarded."""
    found = sorted(PYENV.glob("3.1[2-9].*/bin/python3"))
    if not found:
        pytest.skip(f"harbor needs Python >= 3.12; none under {PYENV}")
    python = compat_python("harbor", HARBOR, base=found[0],  # harbor[e2b]: its extra, pinned
                           also=(f"e2b=={E2B_VERSION}", "dockerfile-parse==2.0.1"))
    done = subprocess.run([str(python), str(DRIVER.parent / "harbor_e2b_driver.py"),
                           str(tmp_path)], env=e2b_env(server), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout)
    assert "start" not in out, out
    assert out["exec"] == [f"built by a RUN step\ntask {out['task']}\n/app\n/app\n", "", 0], out
    assert out["trial"] == {"exception": None, "rewards": {"reward": 1.0}}, out["trial"]
