"""clone_file between two kinds of file system (the kernel's copy_file_range refuses them):
the copy is whole, holes stay holes, and a failure leaves no file."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.substrates.host.image_copy import clone_file


@pytest.fixture
def other_fs() -> Iterator[Path]:
    """A directory on tmpfs (/dev/shm), another file system than tmp_path's."""
    d = Path("/dev/shm") / f"dsec-copy-{secrets.token_hex(4)}"
    d.mkdir()
    try:
        yield d
    finally:
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


def sparse_image(path: Path) -> bytes:
    """64 MiB with data at its start, in its middle and at its end; holes between."""
    chunks = {0: os.urandom(5000), 32 << 20: os.urandom(1 << 20), (64 << 20) - 4096: b"end" * 1365}
    with open(path, "wb") as f:
        f.truncate(64 << 20)
        for offset, data in chunks.items():
            f.seek(offset)
            f.write(data)
    return path.read_bytes()


def test_a_copy_to_another_file_system_is_whole_and_keeps_its_holes(tmp_path: Path,
                                                                     other_fs: Path) -> None:
    if os.stat(tmp_path).st_dev == os.stat(other_fs).st_dev:
        pytest.skip("tmp_path is on /dev/shm's file system")
    src = tmp_path / "disk.img"
    expected = sparse_image(src)
    assert clone_file(src, other_fs / "copy.img") == "sparse"
    assert (other_fs / "copy.img").read_bytes() == expected
    assert os.stat(other_fs / "copy.img").st_blocks * 512 < 8 << 20  # not 64 MiB written
    back = tmp_path / "back.img"
    assert clone_file(other_fs / "copy.img", back) == "sparse"
    assert back.read_bytes() == expected
    assert os.stat(back).st_mode & 0o777 == 0o600


def test_a_failed_copy_leaves_no_file(tmp_path: Path) -> None:
    (tmp_path / "there").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        clone_file(tmp_path / "there", tmp_path / "there")
    with pytest.raises(FileNotFoundError):
        clone_file(tmp_path / "missing", tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
