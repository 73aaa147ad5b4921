"""A `full` snapshot's child has its parent's machine (memory, cpu), whatever its request
asked; the router admits it against a project's quota with these (edge.restored_machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.edge.edge import restored_machine
from dsec.protocol.errors import SnapshotNotFound
from dsec.store.sqlite import SandboxRow, SnapshotRow, StateStore


def _snapshot(mode: str, parent: str = "sb-e-1") -> SnapshotRow:
    return SnapshotRow(f"sn-e-{mode}", "e", parent, "microvm", "img", "sha256:x", mode, 128,
                       4096, 0.0)


def test_a_full_snapshots_child_gets_its_parents_memory_and_cpu(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    store.insert_sandbox(SandboxRow("sb-e-1", "e", "microvm", "img", "sha256:x", "stopped",
                                    {"memory_mb": 384, "cpu": 2.0, "disk_mb": 128}))
    assert restored_machine(store, _snapshot("full")) == {"memory_mb": 384, "cpu": 2.0}
    assert restored_machine(store, _snapshot("filesystem")) == {}  # any machine boots its disk
    with pytest.raises(SnapshotNotFound):  # the parent's record is needed to restore it
        restored_machine(store, _snapshot("full", parent="sb-e-gone"))
