"""The substrates an edge serves, by name: the one place that lists them."""

from __future__ import annotations

from pathlib import Path

from ..config import Settings
from ..images.mount import LayerMounter
from .base import Substrate
from .container.container import ContainerSubstrate
from .fn.fn import FnSubstrate
from .host.volume import DiskVolume
from .vm.microvm import MicroVMSubstrate
from .vm.vm import VMSubstrate

VM_SUBSTRATES = (MicroVMSubstrate, VMSubstrate)


def disk_volume(settings: Settings, state_dir: Path, edge_id: str) -> DiskVolume:
    """The reflink volume of the edge ``edge_id`` whose state is in ``state_dir``."""
    return DiskVolume(state_dir, edge_id, settings.disk_volume, settings.disk_volume_gb)


def all_substrates(settings: Settings, state_dir: Path, edge_id: str,
                   volume: DiskVolume) -> dict[str, Substrate]:
    """Every substrate of the edge ``edge_id`` whose sandboxes live under ``state_dir``
    and on ``volume`` (a dead edge's too, to find and remove its leftovers)."""
    mounter = LayerMounter(settings.state_dir / "layers")  # one per node, shared by its edges
    substrates: dict[str, Substrate] = {
        "container": ContainerSubstrate(state_dir, edge_id, volume, runtime=settings.runtime,
                                        mounter=mounter),
        "fn": FnSubstrate(state_dir, edge_id, preload=settings.fn_preload, mounter=mounter)}
    for vm in VM_SUBSTRATES:
        substrates[vm.name] = vm(state_dir, edge_id, settings.vm_accel, settings.kvm_device,
                                 settings.vm_snapshots, settings.vm_template_idle_s)
    return substrates
