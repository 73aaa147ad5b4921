"""The substrates an edge serves, by name: the one place that lists them."""

from __future__ import annotations

from pathlib import Path

from .base import Substrate
from .container import ContainerSubstrate
from .fn import FnSubstrate
from .microvm import MicroVMSubstrate
from .vm import VMSubstrate

VM_SUBSTRATES = (MicroVMSubstrate, VMSubstrate)


def all_substrates(state_dir: Path, edge_id: str, runtime: str, vm_accel: str,
                   kvm_device: Path, vm_snapshots: bool) -> dict[str, Substrate]:
    substrates: dict[str, Substrate] = {
        "container": ContainerSubstrate(state_dir, edge_id, runtime=runtime),
        "fn": FnSubstrate(state_dir, edge_id)}
    for vm in VM_SUBSTRATES:
        substrates[vm.name] = vm(state_dir, edge_id, vm_accel, kvm_device, vm_snapshots)
    return substrates
