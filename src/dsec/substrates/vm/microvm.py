"""The microvm substrate: QEMU's ``microvm`` machine, a minimal virtual board with no PCI,
no legacy devices beyond a serial port, and virtio-mmio disks and network. The kernel is
entered directly at its PVH entry point (no firmware runs), or, for a kernel without one,
through the tiny qboot firmware that only jumps into it.

Firecracker would fit here too, but no registry this project can use ships its binary (see
docs/SUBSTRATES.md), and it needs working KVM, which this project's CI host lacks.
"""

from __future__ import annotations

from .qemu import QemuSubstrate


class MicroVMSubstrate(QemuSubstrate):
    name = "microvm"
    machine = "microvm"
    disk_device = "virtio-blk-device"
    serial_device = "virtio-serial-device"
    net_device = "virtio-net-device"
    pvh = True
