"""The vm substrate: a full virtual PC (QEMU ``q35``: firmware (SeaBIOS), PCI(e) bus, ACPI,
the legacy chipset) with virtio-pci disks and network, booting the same guest kernel and
agent as the microvm. What differs from ``microvm`` is the machine the guest sees, not the
guest: any driver or tool that expects a real PC finds one.
"""

from __future__ import annotations

from .qemu import QemuSubstrate


class VMSubstrate(QemuSubstrate):
    name = "vm"
    machine = "q35"
    disk_device = "virtio-blk-pci"
    serial_device = "virtio-serial-pci"
    net_device = "virtio-net-pci"
    pvh = False  # a PC boots through its firmware
