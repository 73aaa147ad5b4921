"""remove_tree against trees a sandbox could make: depth, names, counts, links out."""

from __future__ import annotations

import os
from pathlib import Path

from dsec.substrates.host.tree import remove_tree


def _chain(top: Path, depth: int) -> None:
    """A chain deeper than PATH_MAX allows naming, made relative to each level."""
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        below = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = below
    os.close(fd)


def test_removes_deep_odd_and_wide_trees_without_following_links(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("keep")
    top = tmp_path / "top"
    top.mkdir()
    for depth in (1500, 5000):
        (top / f"deep{depth}").mkdir()
        _chain(top / f"deep{depth}", depth)
    (top / "new\nline").mkdir()
    (top / "new\nline" / "f").write_text("x")
    odd = os.fsencode(top) + b"/bad\xff\xfe"
    os.mkdir(odd)
    open(odd + b"/" + b"n" * 255, "w").close()
    wide = top / "wide"
    wide.mkdir()
    for i in range(20000):
        (wide / str(i)).touch()
    for i in range(300):
        (wide / f"d{i}").mkdir()
    os.symlink(victim, top / "dir-link")
    os.symlink(victim / "keep", top / "new\nline" / "file-link")
    os.mkfifo(top / "fifo")
    remove_tree(top)
    assert not top.exists()
    assert (victim / "keep").read_text() == "keep"  # links were removed, never followed


def test_a_file_a_link_and_a_missing_path(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "file").write_text("x")
    os.symlink(target, tmp_path / "link")
    remove_tree(tmp_path / "file")
    remove_tree(tmp_path / "link")  # the link goes, not what it names
    remove_tree(tmp_path / "missing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
