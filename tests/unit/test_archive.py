"""The SDK's archive extractor (``dsec.protocol.archive``) against tars a hostile sandbox would
make, crafted here with the stdlib ``tarfile``: every one is refused with ``UnsafeArchive`` and
leaves nothing outside the destination; an honest tree (links, modes) comes out intact.

Runs under pytest, and under any Python 3.10+ without dsec's dependencies through
``python tests/unit/stdlib_runner.py`` (the extractor needs only the standard library), so the
same checks run on the oldest and newest supported interpreters.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsec.protocol.archive import extract
from dsec.protocol.errors import DSecError, UnsafeArchive


def tar(*members: tuple[tarfile.TarInfo, bytes | None], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as out:
        for info, data in members:
            out.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def file(name: str, data: bytes = b"x", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def entry(name: str, kind: bytes, linkname: str = "", mode: int = 0o755) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, mode
    return info, None


def directory(name: str, mode: int = 0o755) -> tuple[tarfile.TarInfo, None]:
    return entry(name, tarfile.DIRTYPE, mode=mode)


def symlink(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    return entry(name, tarfile.SYMTYPE, target)


def hardlink(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    return entry(name, tarfile.LNKTYPE, target)


@contextmanager
def refused() -> Iterator[None]:
    try:
        yield
    except UnsafeArchive as exc:
        assert isinstance(exc, DSecError) and exc.code == "unsafe_archive"
        return
    raise AssertionError("the archive was extracted")


class Host:
    """A destination inside a directory whose every other entry is the host's: a canary file
    and an empty directory an escape would write to."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.dest = tmp / "dest"
        self.outside = tmp / "outside"
        self.outside.mkdir()
        self.canary = tmp / "canary"
        self.canary.write_bytes(b"host data")

    def untouched(self) -> None:
        assert self.canary.read_bytes() == b"host data"
        assert list(self.outside.iterdir()) == []
        assert {p.name for p in self.tmp.iterdir()} - {"dest", "src"} == {"canary", "outside"}

    def refuses(self, data: bytes, **caps: int) -> None:
        with refused():
            extract(data, self.dest, **caps)
        self.untouched()


def test_names_that_leave_the_destination(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.refuses(tar(file("../canary", b"pwned")))
    host.refuses(tar(file("a/../../canary", b"pwned")))
    host.refuses(tar(file(str(host.canary), b"pwned")))  # an absolute name
    host.refuses(tar(file("/etc/dsec-test-x", b"pwned")))
    assert not Path("/etc/dsec-test-x").exists()


def test_symlink_out_then_a_member_through_it(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.refuses(tar(symlink("link", "/"), file("link/etc/dsec-test-x", b"pwned")))
    host.refuses(tar(symlink("link", str(host.outside)), file("link/x", b"pwned")))
    host.refuses(tar(symlink("link", "../outside"), file("link/x", b"pwned")))
    host.refuses(tar(symlink("up", "..")))
    host.refuses(tar(directory("a"), symlink("a/up", "../../canary")))
    # a symlink that stays inside still never carries a member through it
    host.refuses(tar(directory("sub"), symlink("in", "sub"), file("in/x")))
    assert not Path("/etc/dsec-test-x").exists()


def test_symlink_chains_and_loops(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.refuses(tar(symlink("a", "b"), symlink("b", "c"), symlink("c", "..")))
    host.refuses(tar(symlink("a", "b/.."), symlink("b", "c"), symlink("c", ".")))
    # resolved in the final tree, whatever the order: x is "." only once it is made
    host.refuses(tar(symlink("l", "x/.."), symlink("x", ".")))
    host.refuses(tar(symlink("a", "b"), symlink("b", "a")))
    host.refuses(tar(symlink("self", "self/x")))
    host.refuses(tar(symlink("long", "a/" * 5000)))  # bounded work, however long the target
    # ".." out of a missing directory: a later download could make it a symlink to "."
    host.refuses(tar(symlink("p", "x/..")))
    extract(tar(directory("x"), symlink("p", "x/..")), host.dest)
    assert os.readlink(host.dest / "p") == "x/.."
    host.untouched()


def test_symlink_through_what_the_destination_already_holds(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.dest.mkdir()
    (host.dest / "mine").symlink_to(host.outside)  # the user's own link, out of the destination
    host.refuses(tar(file("mine/x", b"pwned")))
    host.refuses(tar(symlink("via", "mine/x")))
    assert (host.dest / "mine").is_symlink()
    (host.dest / "real").mkdir()
    host.refuses(tar(symlink("real", ".")))  # a directory is never swapped for a symlink
    assert (host.dest / "real").is_dir() and not (host.dest / "real").is_symlink()


def test_hard_links(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.refuses(tar(hardlink("passwd", "/etc/passwd")))
    host.refuses(tar(hardlink("c", "../canary")))
    host.refuses(tar(hardlink("early", "later"), file("later")))  # not extracted yet
    host.refuses(tar(symlink("s", "f"), file("f"), hardlink("h", "s")))  # links name files only
    host.refuses(tar(directory("d"), hardlink("h", "d")))
    extract(tar(file("f", b"data"), hardlink("d/h", "./f")), host.dest)
    assert (host.dest / "d" / "h").read_bytes() == b"data"
    assert os.stat(host.dest / "f").st_ino == os.stat(host.dest / "d" / "h").st_ino
    host.untouched()


def test_a_directory_symlink_swapped_with_a_directory(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.refuses(tar(directory("d"), symlink("d", "../outside"), file("d/x", b"pwned")))
    host.refuses(tar(symlink("d", "sub"), directory("sub"), directory("d"), file("d/x")))
    host.refuses(tar(directory("d"), file("d/f"), symlink("d", ".")))
    host.refuses(tar(file("f"), directory("f")))


def test_devices_fifos_and_unknown_types(tmp_path: Path) -> None:
    host = Host(tmp_path)
    for kind in (tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE, b"Z"):
        info, _ = entry("node", kind)
        info.devmajor, info.devminor = 1, 3  # /dev/null
        host.refuses(tar((info, None)))
        assert not (host.dest / "node").exists()


def test_setuid_and_world_writable_modes_are_cut(tmp_path: Path) -> None:
    host = Host(tmp_path)
    extract(tar(directory("d", 0o7777), file("d/suid", b"#!", 0o6777), file("d/ro", b"r", 0o400)),
            host.dest)
    assert stat.S_IMODE((host.dest / "d" / "suid").stat().st_mode) == 0o755
    assert stat.S_IMODE((host.dest / "d" / "ro").stat().st_mode) == 0o600
    assert stat.S_IMODE((host.dest / "d").stat().st_mode) == 0o755


def test_a_huge_sparse_member_is_capped_before_writing(tmp_path: Path) -> None:
    host = Host(tmp_path)
    info, data = file("sparse", b"x")
    info.pax_headers = {"GNU.sparse.map": "0,1", "GNU.sparse.size": str(1 << 40)}
    archive = tar((info, data))
    with tarfile.open(fileobj=io.BytesIO(archive)) as parsed:
        assert parsed.getmembers()[0].size == 1 << 40  # what tarfile would expand it to
    host.refuses(archive)
    assert not (host.dest / "sparse").exists()
    host.refuses(tar(file("a", b"x" * 600), file("b", b"x" * 600)), max_bytes=1000)
    assert not (host.dest / "a").exists()  # refused before anything is written


def test_a_member_count_bomb(tmp_path: Path) -> None:
    host = Host(tmp_path)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as out:
        for i in range(100_001):
            out.addfile(tarfile.TarInfo(f"f{i}"))
    host.refuses(buf.getvalue())
    assert not host.dest.exists() or list(host.dest.iterdir()) == []
    host.refuses(tar(file("a"), file("b"), file("c")), max_members=2)


def test_cve_2025_4517_long_path_symlink_escape(tmp_path: Path) -> None:
    """The published shape: nested symlinks to 247-character directories take the real path
    past PATH_MAX, where ``os.path.realpath`` (and so the data filter) stops resolving; a
    symlink then climbs out, and members go through it. The first archive here overwrites the
    canary through ``extractall(filter="data")`` on this host's Python 3.10.13, 3.11.7, 3.12.1
    and 3.13.0 (checked by hand)."""
    host = Host(tmp_path)
    comp, steps, path = "d" * 247, "abcdefghijklmnop", ""
    members: list[tuple[tarfile.TarInfo, bytes | None]] = []
    for step in steps:
        members += [directory(os.path.join(path, comp)), symlink(os.path.join(path, step), comp)]
        path = os.path.join(path, comp)
    linkpath = os.path.join(*steps, "l" * 254)
    climb = "../" * len(steps)
    escape = symlink("escape", linkpath + "/..")
    host.refuses(tar(*members, symlink(linkpath, climb), escape, file("escape/canary", b"pwned"),
                     hardlink("escape/canary2", "escape/canary")))
    # the same chain with the climbing link at its real path: only resolution can tell
    host.refuses(tar(*members, symlink(os.path.join(path, "l" * 254), climb), escape))


def test_a_compressed_or_garbage_archive_is_refused(tmp_path: Path) -> None:
    host = Host(tmp_path)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as out:  # decompression is never attempted
        info, data = file("f", b"x" * 100)
        out.addfile(info, io.BytesIO(data))
    host.refuses(buf.getvalue())
    host.refuses(b"\x00garbage" * 100)
    host.refuses(tar(file("f", b"0123456789"))[:700])  # data cut short


def test_an_honest_tree_round_trips_and_extracts_again(tmp_path: Path) -> None:
    """What ``tar -c -C dir .`` makes of a real project: nested directories, relative
    symlinks (``node_modules/.bin``), a hard link, an executable; extracted twice into the
    same destination (a repeated download) it comes out the same."""
    src = tmp_path / "src"
    (src / "node_modules" / "pkg" / "bin").mkdir(parents=True)
    (src / "node_modules" / ".bin").mkdir()
    (src / "node_modules" / "pkg" / "bin" / "run").write_text("#!/bin/sh\n")
    (src / "node_modules" / "pkg" / "bin" / "run").chmod(0o755)
    (src / "node_modules" / ".bin" / "run").symlink_to("../pkg/bin/run")
    (src / "top").symlink_to("node_modules/pkg")
    (src / "README").write_text("hello")
    os.link(src / "README", src / "README.hard")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as out:
        out.add(src, arcname=".")
    host = Host(tmp_path)
    for _ in range(2):
        extract(buf.getvalue(), host.dest)
        assert (host.dest / "node_modules" / ".bin" / "run").read_text() == "#!/bin/sh\n"
        assert os.readlink(host.dest / "node_modules" / ".bin" / "run") == "../pkg/bin/run"
        assert (host.dest / "top" / "bin" / "run").exists()
        assert (host.dest / "README.hard").read_text() == "hello"
        assert os.access(host.dest / "node_modules" / "pkg" / "bin" / "run", os.X_OK)
    host.untouched()
