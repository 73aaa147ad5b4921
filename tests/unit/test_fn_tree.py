"""fn_tree: an fn sandbox's tmpfs trees packed and unpacked, on plain directories (no root, no
chroot: the same code the server runs in a worker's root). Hostile trees and tampered packed
files, as a sandbox trying to reach the host through a snapshot would make them."""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.substrates.fn.fn_tree import (
    DIR_FLAGS,
    EXTENT,
    FILE,
    MAGIC,
    META,
    NAME,
    TREES,
    Packer,
    TreeError,
    Unpacker,
)


@pytest.fixture
def roots(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    src, dst = tmp_path / "src", tmp_path / "dst"
    for root in (src, dst):
        for tree in TREES:
            (root / tree).mkdir(parents=True)
    yield src, dst


def pack(root: Path, max_bytes: int = 1 << 30) -> bytes:
    out = io.BytesIO()
    fd = os.open(root, DIR_FLAGS)
    try:
        Packer(out, max_bytes).pack(fd, TREES)
    finally:
        os.close(fd)
    return out.getvalue()


def unpack(data: bytes, root: Path) -> None:
    fd = os.open(root, DIR_FLAGS)
    try:
        Unpacker(io.BytesIO(data)).unpack(fd, TREES)
    finally:
        os.close(fd)


def record(kind: bytes, name: bytes, mode: int = 0o644) -> bytes:
    return kind + NAME.pack(len(name)) + name + META.pack(mode, os.getuid(), os.getgid(), 0)


def test_a_tree_comes_back_whole(roots: tuple[Path, Path]) -> None:
    src, dst = roots
    work = src / "work"
    (work / "a" / "b").mkdir(parents=True)
    (work / "a" / "b" / "f").write_bytes(b"reward=1")
    (work / "a").chmod(0o751)
    os.link(work / "a" / "b" / "f", work / "hard")
    os.symlink("/etc/passwd", work / "abs")
    os.mkfifo(work / "fifo")  # packed without being opened (it would block)
    (work / os.fsdecode(b"not-utf8-\xff")).write_bytes(b"x")
    with open(work / "sparse", "wb") as f:
        f.truncate(10 << 30)
        f.seek(5 << 30)
        f.write(b"middle")
    (src / "tmp" / "t").write_bytes(b"tmp")
    data = pack(src)
    assert len(data) < 16384  # a 10 GiB sparse file costs the page it holds
    unpack(data, dst)
    out = dst / "work"
    assert (out / "a" / "b" / "f").read_bytes() == b"reward=1"
    assert (out / "a").stat().st_mode & 0o777 == 0o751
    assert os.path.samefile(out / "hard", out / "a" / "b" / "f")
    assert os.readlink(out / "abs") == "/etc/passwd"
    assert (out / "fifo").is_fifo()
    assert (out / os.fsdecode(b"not-utf8-\xff")).read_bytes() == b"x"
    assert (out / "sparse").stat().st_size == 10 << 30
    assert (out / "sparse").stat().st_blocks * 512 < 1 << 20
    with open(out / "sparse", "rb") as f:
        f.seek(5 << 30)
        assert f.read(6) == b"middle"
    assert (dst / "tmp" / "t").read_bytes() == b"tmp"


def test_a_chain_deeper_than_path_max_is_walked_with_one_fd(roots: tuple[Path, Path]) -> None:
    src, dst = roots
    fd = os.open(src / "work", DIR_FLAGS)
    for _ in range(3000):  # 3000 * "deep/" is beyond PATH_MAX
        os.mkdir("deep", dir_fd=fd)
        down = os.open("deep", DIR_FLAGS, dir_fd=fd)
        os.close(fd)
        fd = down
    os.close(fd)
    try:
        unpack(pack(src), dst)
        assert remove_chain(dst / "work") == 3000
    finally:  # pytest's own clean-up of tmp_path recurses: too deep for it
        remove_chain(src / "work")
        remove_chain(dst / "work")


def remove_chain(top: Path) -> int:
    """Remove a chain of ``deep`` directories under ``top``; its depth."""
    fd, depth = os.open(top, DIR_FLAGS), 0
    while "deep" in os.listdir(fd):
        down = os.open("deep", DIR_FLAGS, dir_fd=fd)
        os.close(fd)
        fd, depth = down, depth + 1
    for _ in range(depth):
        up = os.open("..", DIR_FLAGS, dir_fd=fd)
        os.close(fd)
        fd = up
        os.rmdir("deep", dir_fd=fd)
    os.close(fd)
    return depth


def test_links_to_outside_are_kept_as_links_never_followed(roots: tuple[Path, Path],
                                                           tmp_path: Path) -> None:
    src, dst = roots
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "secret").write_bytes(b"host secret")
    os.symlink(outside, src / "work" / "dir-link")
    os.symlink("../../host/secret", src / "work" / "rel-link")
    data = pack(src)
    assert b"host secret" not in data
    unpack(data, dst)
    assert os.readlink(dst / "work" / "dir-link") == str(outside)
    assert sorted(os.listdir(outside)) == ["secret"]


def test_a_hard_link_bomb_is_packed_once(roots: tuple[Path, Path]) -> None:
    src, _ = roots
    (src / "work" / "big").write_bytes(os.urandom(1 << 20))
    for i in range(500):
        os.link(src / "work" / "big", src / "work" / f"l{i}")
    assert len(pack(src)) < (1 << 20) + 100_000  # not 500 MiB


def test_the_packed_size_is_capped(roots: tuple[Path, Path]) -> None:
    src, _ = roots
    (src / "work" / "big").write_bytes(os.urandom(1 << 20))
    with pytest.raises(TreeError, match="exceeds"):
        pack(src, max_bytes=1 << 19)


def stream(*records: bytes) -> bytes:
    return MAGIC + record(b"D", b"work", 0o755) + b"".join(records) + b"U" + b"E"


@pytest.mark.parametrize("name", [b"..", b".", b"a/b", b"", b"x\0y", b"/etc"])
def test_a_tampered_name_is_refused(roots: tuple[Path, Path], name: bytes) -> None:
    _, dst = roots
    with pytest.raises(TreeError, match="bad name"):
        unpack(stream(record(b"D", name), b"U"), dst)


def test_a_tampered_stream_never_writes_through_a_link(roots: tuple[Path, Path],
                                                       tmp_path: Path) -> None:
    """A symlink to a host file, then a file of the same name: creation is exclusive, so the
    host file is never opened."""
    _, dst = roots
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    link = record(b"L", b"x", 0o777) + NAME.pack(len(str(victim))) + str(victim).encode()
    data = FILE.pack(5, 0, 1) + EXTENT.pack(0, 5) + b"owned" + EXTENT.pack(0, 0)
    with pytest.raises(FileExistsError):
        unpack(stream(link, record(b"F", b"x") + data), dst)
    assert victim.read_bytes() == b"untouched"
    with pytest.raises(FileExistsError):  # nor a directory of the same name
        unpack(stream(record(b"D", b"y"), b"U", record(b"D", b"y"), b"U"), dst)


def test_tampered_structure_is_refused(roots: tuple[Path, Path]) -> None:
    _, dst = roots
    cases = {
        "truncated": stream()[:-3],
        "not a packed": b"NOTATREE" + stream()[len(MAGIC):],
        "top level": MAGIC + record(b"D", b"etc") + b"U" + b"E",
        "unknown file": stream(b"H" + NAME.pack(1) + b"h" + struct.pack(">Q", 7)),
        "beyond its size": stream(record(b"F", b"f") + FILE.pack(4, 0, 1) + EXTENT.pack(2, 8)
                                  + b"12345678" + EXTENT.pack(0, 0)),
        "unknown record": stream(record(b"Z", b"z")),
    }
    for match, data in cases.items():
        target = dst.parent / f"dst-{len(os.listdir(dst.parent))}"
        for tree in TREES:
            (target / tree).mkdir(parents=True)
        with pytest.raises(TreeError, match=match):
            unpack(data, target)
