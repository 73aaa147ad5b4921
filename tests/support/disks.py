"""The host's trace of sandbox disks: the loop devices backed by their files. A container
sandbox's disk and overlay are mounted in a mount namespace of its own, never in the host's
table, so a leak check that reads the host's mounts alone would not see a disk left
attached: it looks at the loop devices too."""

from __future__ import annotations

from pathlib import Path


def attached_disks(sandboxes: Path) -> list[str]:
    """The files under ``sandboxes`` that a loop device is attached to."""
    root = str(sandboxes) + "/"
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            name = backing.read_text().strip()
        except OSError:  # detached while being read
            continue
        if name.startswith(root):
            found.append(name)
    return found
