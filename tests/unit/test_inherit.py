"""A sandbox made from a snapshot has its parent's limits, network policy, runtime,
environment and TTL for every field its request leaves unset, the snapshot's image and disk
always, and for a `full` snapshot the parent's machine (edge/inherit.py). The router admits
the create against a project's quota with these values, so they are checked here on the
request the quota sees. A real state store: the inheritance travels in the snapshot's record."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.edge.inherit import from_snapshot, inheritance
from dsec.protocol.errors import InvalidRequest, SnapshotNotFound
from dsec.protocol.models import CreateRequest, NetworkPolicy
from dsec.store.sqlite import SandboxRow, SnapshotRow, StateStore

PARENT = CreateRequest(substrate="microvm", image="img", cpu=2.0, memory_mb=384, pids=64,
                       disk_mb=128, ttl_s=900, network={"allow": ["10.1.2.3:443"]},
                       env={"A": "parent", "B": "parent"}, runtime="runsc",
                       labels={"who": "parent"}).model_dump()


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    return StateStore(tmp_path / "state.db")


def _snapshot(store: StateStore, mode: str = "filesystem", parent: str = "sb-e-1",
              inherited: dict | None = None) -> SnapshotRow:
    row = SnapshotRow(f"sn-e-{mode}-{parent}", "e", parent, "microvm", "img", "sha256:x", mode, 128,
                      4096, 0.0, inherited=inherited)
    store.insert_snapshot(row)
    stored = store.get_snapshot(row.id)
    assert stored is not None and stored.inherited == inherited  # through the store's JSON
    return stored


def test_unset_fields_are_the_parents_set_ones_the_requests(store: StateStore) -> None:
    snap = _snapshot(store, inherited=inheritance(PARENT))
    child = from_snapshot(CreateRequest(snapshot=snap.id), snap, store)
    assert (child.cpu, child.memory_mb, child.pids, child.ttl_s, child.runtime) == \
        (2.0, 384, 64, 900, "runsc")
    assert child.network == NetworkPolicy(allow=["10.1.2.3:443"])  # validated as a policy
    assert child.env == {"A": "parent", "B": "parent"}
    assert child.labels == {} and (child.image, child.substrate, child.disk_mb) == ("img", "microvm", 128)

    given = CreateRequest(snapshot=snap.id, cpu=0.5, memory_mb=256, network="none",
                          env={"B": "child"}, ttl_s=60, image="other", disk_mb=4096)
    child = from_snapshot(given, snap, store)
    assert (child.cpu, child.memory_mb, child.network, child.ttl_s) == (0.5, 256, "none", 60)
    assert child.pids == 64  # not given: still the parent's
    assert child.env == {"A": "parent", "B": "child"}  # added to the parent's
    assert (child.image, child.disk_mb) == ("img", 128)  # the snapshot's, whatever is asked


def test_applying_it_again_changes_nothing(store: StateStore) -> None:
    """The router applies it, then the edge does: the edge must start what the quota admitted."""
    snap = _snapshot(store, inherited=inheritance(PARENT))
    once = from_snapshot(CreateRequest(snapshot=snap.id, memory_mb=64, env={"C": "1"}), snap, store)
    assert from_snapshot(once, snap, store) == once
    assert once.memory_mb == 64


def test_a_snapshot_of_before_inheritance_uses_the_parents_record_or_the_defaults(
        store: StateStore) -> None:
    snap = _snapshot(store)
    assert from_snapshot(CreateRequest(snapshot=snap.id), snap, store).memory_mb == 512
    store.insert_sandbox(SandboxRow("sb-e-1", "e", "microvm", "img", "sha256:x", "stopped", PARENT))
    assert from_snapshot(CreateRequest(snapshot=snap.id), snap, store).memory_mb == 384


def test_a_full_snapshots_child_gets_its_parents_machine_whatever_it_asks(store: StateStore) -> None:
    snap = _snapshot(store, "full", inherited=inheritance(PARENT))
    child = from_snapshot(CreateRequest(snapshot=snap.id, cpu=0.5, memory_mb=64, pids=32),
                          snap, store)
    assert (child.cpu, child.memory_mb, child.pids) == (2.0, 384, 32)
    legacy = _snapshot(store, "full", parent="sb-e-gone")
    with pytest.raises(SnapshotNotFound):  # the saved memory is that size: no default fits
        from_snapshot(CreateRequest(snapshot=legacy.id), legacy, store)


def test_an_inheritance_no_longer_valid_is_a_typed_error(store: StateStore) -> None:
    snap = _snapshot(store, inherited={**inheritance(PARENT), "network": {"allow": ["no such rule"]}})
    with pytest.raises(InvalidRequest):
        from_snapshot(CreateRequest(snapshot=snap.id), snap, store)
    assert from_snapshot(CreateRequest(snapshot=snap.id, network="none"), snap, store).network == "none"
