"""The microvm and vm substrates: QEMU machines booting the host's guest kernel with the
dsec agent, their network and snapshots."""
