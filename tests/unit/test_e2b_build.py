"""E2B template steps as a Dockerfile (compat/e2b_build.py), the upload tokens and re-packing,
and the projects' image names (control/image_names.py): no step's text becomes another
instruction, no upload escapes its prefix, no project names another's image."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from dsec.compat.e2b_build import Uploads, dockerfile
from dsec.control.image_names import built_name, check_visible
from dsec.images.dockerfile import parse
from dsec.protocol.build import allow_network
from dsec.protocol.errors import ImageNotFound, InvalidRequest, UnsafeArchive
from dsec.protocol.models import NetworkPolicy

HASH = "0" * 64


def test_steps_become_instructions_and_nothing_more() -> None:
    steps = [("ENV", ["A", "one two", "B", "$x'q"]), ("WORKDIR", ["/srv/my app"]),
             ("RUN", ["echo hi\nFROM evil\necho 'x'"]), ("RUN", ["id -un", "root"]),
             ("USER", ["app"]), ("COPY", ["src/*.py", "/srv/", "1000:1000", "0755"]),
             ("COPY", ["data", "/data", "app"]), ("RUN", ["id -un"])]
    text = dockerfile("debian-minbase", steps, [None, None, None, None, None, HASH, HASH, None],
                      "nobody")
    instructions = parse(text)
    assert [i.keyword for i in instructions] == [
        "FROM", "USER", "ENV", "WORKDIR", "RUN", "USER", "RUN", "USER", "USER", "COPY", "COPY",
        "RUN", "RUN"]
    assert instructions[4].argv == ("/bin/sh", "-c", "echo hi\nFROM evil\necho 'x'")
    assert [i.args for i in instructions if i.keyword == "USER"] == ["nobody", "root", "nobody",
                                                                    "app"]
    assert instructions[9].argv == (f"{HASH}/src/*.py", "/srv/")
    assert instructions[9].flags == {"chmod": "0755", "chown": "1000:1000"}
    assert instructions[11].argv == ("chown", "-R", "app", "/data")  # a user by name


@pytest.mark.parametrize("step", [("ENV", ["A", "line\nRUN evil"]), ("WORKDIR", ["/a\n/b"]),
                                  ("USER", ["root\nRUN x"]), ("USER", ["a b"]),
                                  ("COPY", ["a\nb", "/x"]), ("COPY", ["a", "/x", "u;rm"])])
def test_a_step_that_would_make_another_instruction_is_refused(step: tuple[str, list[str]]) -> None:
    with pytest.raises(InvalidRequest):
        dockerfile("debian-minbase", [step], [HASH if step[0] == "COPY" else None], None)


def _tar(*members: tuple[str, bytes, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.type, info.size = kind, len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)
    return out.getvalue()


def test_uploads_tokens_and_repacking(tmp_path: Path) -> None:
    uploads = Uploads(tmp_path / "uploads")
    token = uploads.token("p", "tpl-1", HASH)
    assert uploads.project_of(token, "tpl-1", HASH) == "p"
    for forged in (uploads.token("p", "tpl-2", HASH), "q." + token.partition(".")[2], "", "p."):
        assert uploads.project_of(forged, "tpl-1", HASH) is None
    with pytest.raises(InvalidRequest):
        uploads.put("tpl-1", "../../x", b"")
    uploads.put("tpl-1", HASH, _tar(("./a.txt", tarfile.REGTYPE, b"a"),
                                    ("./.hidden", tarfile.REGTYPE, b"h")))
    with tarfile.open(fileobj=io.BytesIO(uploads.context("tpl-1", [HASH]))) as tar:
        assert tar.getnames() == [f"{HASH}/a.txt", f"{HASH}/.hidden"]  # names kept, prefixed
    with pytest.raises(InvalidRequest, match="not uploaded"):
        uploads.context("tpl-1", ["1" * 64])
    uploads.put("tpl-1", HASH, _tar(("dev", tarfile.CHRTYPE, b"")))
    with pytest.raises(UnsafeArchive):
        uploads.context("tpl-1", [HASH])
    uploads.put("tpl-1", HASH, b"\x1f\x8b not really gzip")
    with pytest.raises(UnsafeArchive):
        uploads.context("tpl-1", [HASH])
    uploads.drop("tpl-1")
    assert not (tmp_path / "uploads" / "tpl-1").exists()


def test_a_projects_images_are_its_own() -> None:
    assert built_name("env", None) == "env"  # an admin key names images as it likes
    assert built_name("env", "team-a") == "p.team-a.env"
    for bad in ("p.team-b.env", "a/b", "", "x" * 127, "env\n", "-x"):
        with pytest.raises(InvalidRequest):
            built_name(bad, "team-a")
    check_visible("p.team-a.env", "team-a")
    check_visible("p.team-b.env", None)
    for public in ("python-3.11", "python:3.11", "p.example.com/team/x:1", "pypy"):
        check_visible(public, "team-a")
    with pytest.raises(ImageNotFound):
        check_visible("p.team-b.env", "team-a")
    with pytest.raises(ImageNotFound):
        check_visible("p.team-ab.env", "team-a")


def test_allow_items_become_the_run_steps_egress() -> None:
    """``--allow`` and ``DSEC_E2B_BUILD_ALLOW`` (comma-split): names are services, the rest
    raw rules; nothing is no network."""
    assert allow_network([]) == "none" and allow_network(["", " "]) == "none"
    policy = allow_network(["pypi", " 10.1.2.3:443", "10.0.0.0/8"])
    assert isinstance(policy, NetworkPolicy)
    assert policy.services == {"pypi": True} and policy.allow == ["10.1.2.3:443", "10.0.0.0/8"]
    with pytest.raises(ValueError):
        allow_network(["300.1.2.3:99999"])
