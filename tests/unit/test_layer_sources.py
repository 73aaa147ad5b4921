"""Hostile trees to layers (images/upper.py) and build contexts to tars (build_context.py)."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from dsec.images.build_context import context_copy
from dsec.images.upper import MAX_DEPTH, OPAQUE, copy_upper
from dsec.protocol.errors import ImageBuildError, InvalidRequest, NotSupported

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts and owners need root")


def hostile_upper(root: Path, outside: Path) -> Path:
    upper = root / "upper"
    (upper / "etc").mkdir(parents=True)
    (upper / "opaque").mkdir()
    os.setxattr(upper / "opaque", OPAQUE, b"y")
    os.setxattr(upper / "etc", "user.other", b"x")
    (upper / "etc" / "file").write_text("data")
    os.chown(upper / "etc" / "file", 1000, 1000)
    os.link(upper / "etc" / "file", upper / "etc" / "hardlink")
    (upper / "to-host").symlink_to(outside)
    (upper / "dir-link").symlink_to(outside)
    os.mknod(upper / "etc" / "gone", stat.S_IFCHR | 0o000, 0)  # a whiteout
    os.mknod(upper / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mkfifo(upper / "fifo")
    (upper / ".wh.etc").write_text("just a file")
    (upper / ".dsec").mkdir()
    (upper / ".dsec" / "tool").write_text("mount point content")
    return upper


def test_upper_copy_keeps_links_whiteouts_and_drops_devices(tmp_path: Path) -> None:
    outside = tmp_path / "host"
    outside.mkdir()
    upper = hostile_upper(tmp_path, outside)
    dest = tmp_path / "layer"
    dropped = copy_upper(upper, dest, 1 << 20, skip_top=(".dsec",))
    assert sorted(dropped) == ["/fifo", "/null"]
    assert os.readlink(dest / "to-host") == str(outside)  # kept as a link, never followed
    assert list(outside.iterdir()) == []
    gone = os.lstat(dest / "etc" / "gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0
    assert os.getxattr(dest / "opaque", OPAQUE) == b"y"
    assert "user.other" not in os.listxattr(dest / "etc")
    st = os.stat(dest / "etc" / "file")
    assert (st.st_uid, st.st_gid, st.st_nlink) == (1000, 1000, 2)
    assert (dest / ".wh.etc").read_text() == "just a file"
    assert not (dest / ".dsec").exists()


def test_upper_copy_counts_sparse_files_whole(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    with open(upper / "sparse", "wb") as f:
        f.truncate(64 << 20)
    with pytest.raises(ImageBuildError, match="more than its disk"):
        copy_upper(upper, tmp_path / "layer", 16 << 20)


def test_upper_copy_refuses_a_too_deep_tree(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(MAX_DEPTH + 5):  # by descriptor: deeper than any path the host could name
        os.mkdir("d", dir_fd=fd)
        fd, old = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
        os.close(old)
    os.close(fd)
    with pytest.raises(ImageBuildError, match="directories deep"):
        copy_upper(upper, tmp_path / "layer", 1 << 30)


def members(tar: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        return {m.name: m for m in t.getmembers()}


def test_context_copy_forms_and_owners(tmp_path: Path) -> None:
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "m.py").write_text("x = 1\n")
    (tmp_path / "src" / "link").symlink_to("pkg/m.py")
    (tmp_path / "a.txt").write_text("a")
    tree = context_copy(tmp_path, ["src"], "/app/", "/", "COPY", chown="1000:1001")
    assert tree.directory == "/app"
    found = members(tree.tar)
    assert set(found) == {"pkg", "pkg/m.py", "link"}
    assert (found["pkg/m.py"].uid, found["pkg/m.py"].gid) == (1000, 1001)
    assert found["link"].linkname == "pkg/m.py"
    renamed = context_copy(tmp_path, ["a.txt"], "b.txt", "/work", "COPY")
    assert (renamed.directory, list(members(renamed.tar))) == ("/work", ["b.txt"])
    into = context_copy(tmp_path, ["*.txt"], ".", "/work", "COPY", chmod="600")
    assert into.into_dir and members(into.tar)["a.txt"].mode == 0o600
    assert into.digest != renamed.digest


def test_dockerignore_leaves_paths_out(tmp_path: Path) -> None:
    for rel in (".git/config", "app/main.py", "app/cache/x.pyc", "app/keep.pyc", "notes.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    (tmp_path / ".dockerignore").write_text("# comment\n.git\n**/*.pyc\n!app/keep.pyc\n*.md\n")
    copied = members(context_copy(tmp_path, ["."], "/src/", "/", "COPY").tar)
    assert {n for n, m in copied.items() if m.isfile()} == {
        ".dockerignore", "app/main.py", "app/keep.pyc"}
    with pytest.raises(InvalidRequest, match="dockerignore"):
        context_copy(tmp_path, ["*.md"], "/src/", "/", "COPY")


@pytest.mark.parametrize("source", ["../x", "/../x", "escape", "tree", "nothing-here"])
def test_context_copy_refuses_escapes(tmp_path: Path, source: str) -> None:
    context = tmp_path / "ctx"
    (context / "tree").mkdir(parents=True)
    (tmp_path / "x").write_text("secret")
    (context / "escape").symlink_to(tmp_path / "x")
    (context / "tree" / "out").symlink_to("../../x")
    with pytest.raises(InvalidRequest):
        context_copy(context, [source], "/d/", "/", "COPY")


@pytest.mark.parametrize("source", ["http://example.invalid/a", "a.tar.gz"])
def test_add_of_urls_and_archives_is_not_supported(tmp_path: Path, source: str) -> None:
    (tmp_path / "a.tar.gz").write_bytes(b"")
    with pytest.raises(NotSupported):
        context_copy(tmp_path, [source], "/d/", "/", "ADD")
