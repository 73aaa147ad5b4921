"""The shared snapshot directory: an export is whole or absent, a fetch checks it, and the
digest is of the content (a sparse and a dense copy agree). A tampered export is refused and
leaves nothing, as a tenant with write access to the shared mount would tamper with it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.edge.shared_snapshots import BLOCK, SharedSnapshots, content_digest
from dsec.protocol.errors import SnapshotCorrupt

SIZE = 64 << 20


def sparse_image(path: Path) -> Path:
    with open(path, "wb") as f:
        f.truncate(SIZE)
        f.seek(20 << 20)
        f.write(os.urandom(3 * BLOCK + 17))
        f.seek(SIZE - 5)
        f.write(b"tail!")
    return path


def test_export_then_fetch_round_trips_sparsely(tmp_path: Path) -> None:
    shared = SharedSnapshots(tmp_path / "shared")
    local = sparse_image(tmp_path / "disk.img")
    digest, size = shared.export("sn-a", local)
    assert size == SIZE and shared.path("sn-a").exists()
    assert list((tmp_path / "shared" / "tmp").iterdir()) == []
    assert shared.path("sn-a").stat().st_blocks * 512 < 8 << 20  # holes stayed holes
    dest = tmp_path / "node-b" / "disk.img"
    dest.parent.mkdir()
    shared.fetch("sn-a", digest, size, dest)
    assert dest.read_bytes() == local.read_bytes()
    shared.remove("sn-a")
    assert not shared.path("sn-a").exists()


def test_the_digest_is_of_content_not_layout(tmp_path: Path) -> None:
    sparse = sparse_image(tmp_path / "sparse")
    dense = tmp_path / "dense"
    with open(sparse, "rb") as src, open(dense, "wb") as dst:  # every hole written as zeros
        while chunk := src.read(64 << 20):
            dst.write(chunk)
    assert dense.stat().st_blocks > sparse.stat().st_blocks
    assert content_digest(sparse) == content_digest(dense)
    with open(dense, "r+b") as f:  # one byte in a block that was a hole
        f.seek(40 << 20)
        f.write(b"\1")
    assert content_digest(sparse) != content_digest(dense)


@pytest.mark.parametrize("damage", ["truncate", "flip", "extend", "swap", "remove"])
def test_a_tampered_export_is_refused_and_leaves_nothing(tmp_path: Path, damage: str) -> None:
    shared = SharedSnapshots(tmp_path / "shared")
    digest, size = shared.export("sn-a", sparse_image(tmp_path / "disk.img"))
    exported = shared.path("sn-a")
    if damage == "truncate":
        os.truncate(exported, size - 1)
    elif damage == "flip":
        with open(exported, "r+b") as f:
            f.seek((20 << 20) + 5)
            byte = f.read(1)
            f.seek((20 << 20) + 5)
            f.write(bytes([byte[0] ^ 1]))
    elif damage == "extend":
        os.truncate(exported, size + 4096)
    elif damage == "swap":  # another snapshot's valid export under this one's name
        other = tmp_path / "other.img"
        other.write_bytes(b"x")
        os.truncate(other, size)
        os.replace(other, exported)
    else:
        exported.unlink()
    node = tmp_path / "node-b"
    node.mkdir()
    with pytest.raises(SnapshotCorrupt):
        shared.fetch("sn-a", digest, size, node / "disk.img")
    assert list(node.iterdir()) == []


def test_sweep_takes_unrecorded_exports_and_stale_temp_copies(tmp_path: Path) -> None:
    shared = SharedSnapshots(tmp_path / "shared")
    local = sparse_image(tmp_path / "disk.img")
    for snapshot_id in ("sn-kept", "sn-deleted"):
        shared.export(snapshot_id, local)
    stale, fresh = tmp_path / "shared" / "tmp" / "sn-x.1", tmp_path / "shared" / "tmp" / "sn-y.2"
    stale.write_bytes(b"cut")
    fresh.write_bytes(b"under way")
    os.utime(stale, (0, 0))
    removed = shared.sweep(lambda snapshot_id: snapshot_id == "sn-kept")
    assert sorted(removed) == ["sn-deleted.img", "tmp/sn-x.1"]
    assert shared.path("sn-kept").exists() and fresh.exists()
