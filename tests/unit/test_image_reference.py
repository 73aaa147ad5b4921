"""Image references (Docker's rules: registry or Docker Hub, ``library/``, ``:latest``) and the
registry's ``WWW-Authenticate`` challenges, parsed as a registry (hostile) may send them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dsec.images.reference import Reference, parse_reference
from dsec.images.registry import credentials, parse_challenge, plain_http
from dsec.protocol.errors import InvalidRequest

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(("text", "expected"), [
    ("python", Reference("docker.io", "library/python", "latest", None)),
    ("python:3.11-slim", Reference("docker.io", "library/python", "3.11-slim", None)),
    ("team/task", Reference("docker.io", "team/task", "latest", None)),
    ("registry.example/team/swe-task:1.2", Reference("registry.example", "team/swe-task", "1.2", None)),
    ("127.0.0.1:5000/a/b/c:v1", Reference("127.0.0.1:5000", "a/b/c", "v1", None)),
    ("localhost/x", Reference("localhost", "x", "latest", None)),
    (f"python@{DIGEST}", Reference("docker.io", "library/python", None, DIGEST)),
    (f"reg.io:443/x:1@{DIGEST}", Reference("reg.io:443", "x", "1", DIGEST)),
    ("[::1]:5000/x", Reference("[::1]:5000", "x", "latest", None)),
    ("my_org/my-repo__x.y", Reference("docker.io", "my_org/my-repo__x.y", "latest", None)),
])
def test_references_follow_dockers_rules(text: str, expected: Reference) -> None:
    ref = parse_reference(text)
    assert ref == expected
    assert parse_reference(ref.canonical) == ref  # the canonical spelling names the same image


def test_canonical_names_and_api_hosts() -> None:
    hub = parse_reference("python:3.11-slim")
    assert hub.canonical == "docker.io/library/python:3.11-slim"
    assert hub.api_host == "registry-1.docker.io" and hub.pinned == "3.11-slim"
    pinned = parse_reference(f"reg.example/x:1@{DIGEST}")
    assert pinned.pinned == DIGEST and pinned.api_host == "reg.example"


@pytest.mark.parametrize("text", [
    "", " python", "Python", "UPPER/case", "a//b", "a/", "/a", "a:", "a:-x", "a:" + "t" * 129,
    "a@sha256:abc", "a@md5:" + "0" * 32, "a@" + DIGEST.upper(), "-a", "a..b", "a/../b",
    "reg.example:99999999/x", "x" * 600, "a b", "a\nb", "a:b:c", "reg.example/a:b/c",
])
def test_bad_references_are_invalid_requests(text: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_reference(text)


@pytest.mark.parametrize(("header", "scheme", "params"), [
    ('Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
     'scope="repository:library/python:pull"',
     "bearer", {"realm": "https://auth.docker.io/token", "service": "registry.docker.io",
                "scope": "repository:library/python:pull"}),
    ('Basic realm="Registry Realm"', "basic", {"realm": "Registry Realm"}),
    ('bearer realm=https://r.example/t, service=r.example', "bearer",
     {"realm": "https://r.example/t", "service": "r.example"}),
    ('Bearer realm="a\\"b",scope="repository:x:pull,push"', "bearer",
     {"realm": 'a"b', "scope": "repository:x:pull,push"}),
    ("", "", {}),
    ("Bearer", "bearer", {}),
    ('Bearer realm="unterminated', "bearer", {"realm": ""}),  # no realm: refused
    ("Bearer ,,,=garbage", "bearer", {}),
])
def test_challenges_parse_as_sent(header: str, scheme: str, params: dict[str, str]) -> None:
    assert parse_challenge(header) == (scheme, params)


def test_only_loopback_and_configured_registries_are_plain_http(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plain_http("127.0.0.1:5000") and plain_http("localhost:5000") and plain_http("[::1]:80")
    assert not plain_http("registry.example") and not plain_http("10.0.0.1:5000")
    monkeypatch.setenv("DSEC_REGISTRY_HTTP", "10.0.0.1:5000,other")
    assert plain_http("10.0.0.1:5000") and not plain_http("10.0.0.2:5000")


def test_credentials_from_a_docker_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import base64
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"auths": {
        "https://index.docker.io/v1/": {"auth": base64.b64encode(b"hub:pw:with:colons").decode()},
        "reg.example": {"username": "u", "password": "p"},
        "bad.example": {"auth": "%%%"},
    }}))
    monkeypatch.setenv("DSEC_REGISTRY_AUTH", str(config))
    assert credentials("docker.io") == ("hub", "pw:with:colons")
    assert credentials("reg.example") == ("u", "p")
    assert credentials("other.example") is None
    with pytest.raises(InvalidRequest):
        credentials("bad.example")
    monkeypatch.setenv("DSEC_REGISTRY_AUTH", str(tmp_path / "absent.json"))
    assert credentials("reg.example") is None
    monkeypatch.delenv("DSEC_REGISTRY_AUTH")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert credentials("reg.example") == ("u", "p")
    assert os.environ["DOCKER_CONFIG"] == str(tmp_path)
