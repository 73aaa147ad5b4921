"""Where a container sandbox's mounts live: a mount namespace of its own (``host/mountns.py``
says why), held by the server, and how the server reaches them from its own.

Each sandbox has a ``MountSpace``: an fd holding its namespace (its runtime is started in
it, its disk and overlay are mounted in it) and an fd on its bundle dir opened there, so
``/proc/self/fd/<view>/disk/...`` reaches its disk from any thread of the server. Nothing of
it is in the host's mount table; the namespace goes when the server lets it go (the
sandbox's own namespace keeps what its processes use meanwhile).

A restarted server holds none of them: the first time it needs an adopted sandbox's disk,
that disk is mounted again in a new namespace. It is found by its loop device (named in the
sandbox's runtime facts, written by dsec) whose backing file must be the sandbox's
``disk.img``: never by a path or name the sandbox can write. A sandbox being removed is
marked so until its dir is gone, so a call racing with its stop cannot mount its disk
again behind the removal.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ...protocol.errors import SandboxError
from ..host.loop import backing_file, holder, mount_device
from ..host.mountns import inside, new_private, own_fs


class MountSpace:
    """A sandbox's mount namespace (an fd holding it), its bundle dir seen from there, and
    the loop device of the disk mounted in it."""

    def __init__(self, namespace: int, view: int) -> None:
        self.namespace, self.view = namespace, view
        self.disk: str | None = None

    def path(self) -> Path:
        """The bundle dir with the sandbox's mounts, for any thread of this process."""
        return Path(f"/proc/self/fd/{self.view}")

    def close(self) -> None:
        os.close(self.view)
        os.close(self.namespace)


class MountSpaces:
    """The ``MountSpace`` of each sandbox of a substrate, by id; ``bundle(id)`` is its dir."""

    def __init__(self, bundle: Callable[[str], Path]) -> None:
        self._bundle = bundle
        self._spaces: dict[str, MountSpace | None] = {}  # None: being removed
        self._lock = threading.Lock()
        # Adopted sandboxes get their disk back here, never waiting behind the I/O threads
        self._again = ThreadPoolExecutor(1, thread_name_prefix="dsec-mount-again",
                                         initializer=own_fs)

    def make(self, sandbox_id: str) -> MountSpace:
        """A new namespace for the sandbox, kept until ``removing``; from an ``own_fs``
        thread. The sandbox's bundle dir must exist."""
        namespace = new_private()
        try:
            with inside(namespace):
                view = os.open(self._bundle(sandbox_id), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except BaseException:
            os.close(namespace)
            raise
        space = MountSpace(namespace, view)
        with self._lock:
            if sandbox_id in self._spaces:
                space.close()
                raise SandboxError(f"sandbox {sandbox_id} already has its mounts, or is being "
                                   "removed", sandbox_id=sandbox_id)
            self._spaces[sandbox_id] = space
        return space

    def get(self, sandbox_id: str, runtime: dict[str, Any] | None = None) -> MountSpace:
        """The sandbox's space; for one this server did not start (adopted after a restart),
        its disk mounted again first (blocking)."""
        with self._lock:
            known, space = sandbox_id in self._spaces, self._spaces.get(sandbox_id)
        if space is not None:
            return space
        if known:
            raise SandboxError(f"sandbox {sandbox_id} is being removed", sandbox_id=sandbox_id)
        return self._again.submit(self._mounted_again, sandbox_id, runtime or {}).result()

    def _mounted_again(self, sandbox_id: str, runtime: dict[str, Any]) -> MountSpace:
        if (space := self._spaces.get(sandbox_id)) is not None:  # by an earlier call
            return space
        image = self._bundle(sandbox_id) / "disk.img"
        # The facts name the device since this version; before, the devices are searched.
        dev = runtime.get("disk") or holder(image)
        if dev is None or backing_file(dev) != os.path.realpath(image):
            raise SandboxError(f"sandbox {sandbox_id}'s disk is gone", sandbox_id=sandbox_id)
        space = self.make(sandbox_id)
        try:
            with inside(space.namespace):
                mount_device(dev, self._bundle(sandbox_id) / "disk", "ext4")
        except BaseException:
            with self._lock:
                del self._spaces[sandbox_id]
            space.close()
            raise
        space.disk = dev
        return space

    def removing(self, sandbox_id: str) -> MountSpace | None:
        """The sandbox's space taken out for its removal (None if this server holds none),
        the sandbox marked as being removed until ``removed``."""
        with self._lock:
            space = self._spaces.get(sandbox_id)
            self._spaces[sandbox_id] = None
        return space

    def removed(self, sandbox_id: str) -> None:
        with self._lock:
            self._spaces.pop(sandbox_id, None)
