"""The sweep of VM snapshot templates (``substrates/vm/vmsnapshot.py``): which templates go,
which stay, and that it reads only what dsec wrote, over a cache directory laid out the way
builders, restores and dead processes leave it."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import time
from pathlib import Path

import pytest

from dsec.substrates.vm import vmsnapshot

DAY = 86400.0


def _template(root: Path, key: str, inputs: list[Path] | None = None, age_s: float = 0,
              users: tuple[Path, ...] = ()) -> Path:
    """A template as ``_build_template`` commits it, used by ``users``, last used ``age_s``
    ago (``inputs`` None: one made before templates named their inputs)."""
    scratch = root / f".{key}.abcd1234"
    scratch.mkdir(parents=True)
    (scratch / "state.bin").write_bytes(b"s" * 8192)
    (scratch / "disk.ext4").write_bytes(b"d" * 4096)
    if inputs is not None:
        vmsnapshot.record_inputs(scratch, inputs)
    vmsnapshot.commit(scratch, root / key)
    for user in users:
        vmsnapshot.use(root / key, user)
    (root / vmsnapshot._lock_path(root, key).name).touch()
    then = time.time() - age_s
    os.utime(root / key, (then, then))
    return root / key


def _sweep(root: Path, idle_s: float = DAY) -> int:
    return vmsnapshot.sweep(root, time.time(), idle_s)


def test_a_template_goes_when_idle_or_unrestorable_and_stays_while_used(tmp_path: Path) -> None:
    root, files = tmp_path / "vm-snapshots", tmp_path / "inputs"
    files.mkdir()
    kernel, initramfs = files / "vmlinux", files / "initramfs.cpio"
    kernel.touch()
    initramfs.touch()
    live, gone = tmp_path / "vms" / "sb-live", tmp_path / "vms" / "sb-gone"
    live.mkdir(parents=True)
    gone.mkdir()
    fresh = _template(root, "a" * 16, [kernel, initramfs])
    idle = _template(root, "b" * 16, [kernel, initramfs], age_s=2 * DAY)
    old_format_idle = _template(root, "c" * 16, None, age_s=2 * DAY)
    old_format_fresh = _template(root, "d" * 16, None)
    used_idle = _template(root, "e" * 16, [kernel, initramfs], age_s=2 * DAY, users=[live, gone])
    agent_rebuilt = _template(root, "f" * 16, [kernel, files / "initramfs-of-an-older-dsec"])
    shutil.rmtree(gone)  # its sandbox's directory removed with no release (a crash's remains)
    freed = _sweep(root)
    assert {p.name for p in root.iterdir() if not p.name.startswith(".")} == \
        {fresh.name, old_format_fresh.name, used_idle.name}
    assert freed >= 3 * (8192 + 4096)
    for removed in (idle, old_format_idle, agent_rebuilt):  # and their locks
        assert not vmsnapshot._lock_path(root, removed.name).exists()
    assert [p.name for p in (used_idle / "users").iterdir()] == ["sb-live"]  # gone's pruned
    vmsnapshot.release(live)  # its sandbox destroyed: nothing uses it any more
    assert list((used_idle / "users").iterdir()) == []
    _sweep(root)
    assert not used_idle.exists()
    assert live.exists()  # a link is never followed into what it names


def test_a_locked_template_is_left_and_a_waiting_user_locks_the_next_file(
        tmp_path: Path) -> None:
    root = tmp_path / "vm-snapshots"
    idle = _template(root, "a" * 16, None, age_s=2 * DAY)
    with open(vmsnapshot._lock_path(root, idle.name), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a create building or taking it into use
        _sweep(root)
        assert idle.exists()

    async def take_after_sweep() -> bool:
        lock = vmsnapshot.TemplateLock(idle)
        async with lock:  # the sweep removed the file this waited on: it locks a new one
            return vmsnapshot._lock_path(root, idle.name).exists()

    assert _sweep(root) > 0 and not idle.exists()
    assert asyncio.run(take_after_sweep())


def test_the_sweep_reads_only_what_dsec_wrote(tmp_path: Path) -> None:
    """Names not of the cache's own patterns, links and nested trees are left alone (a
    template's disk is a file its VM wrote; the sweep never recurses or follows)."""
    root = tmp_path / "vm-snapshots"
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep").write_text("x")
    root.mkdir()
    (root / ("1" * 16)).symlink_to(outside)  # a link named like a template
    (root / "notes").mkdir()  # not a template's name
    (root / ".2222222222222222.lock").touch()  # a lock of no template
    odd = _template(root, "3" * 16, None, age_s=2 * DAY)
    (odd / "nested").mkdir()  # something dsec never puts there
    (odd / "nested" / "deep").write_text("x")
    os.utime(odd, (time.time() - 2 * DAY,) * 2)
    dead_builder = root / ".4444444444444444.qwer_123"
    dead_builder.mkdir()
    (dead_builder / "console.log").write_text("boot")
    (dead_builder / "disk.ext4").write_bytes(b"d" * 4096)
    _sweep(root)
    assert (outside / "keep").read_text() == "x" and (root / ("1" * 16)).is_symlink()
    assert (root / "notes").is_dir()
    assert not (root / ".2222222222222222.lock").exists()
    assert not dead_builder.exists()
    # The odd template is gone for creates (renamed aside at once); its nested tree stopped
    # the removal, which is logged, and stays for an operator.
    assert not odd.exists()
    (left,) = [p for p in root.iterdir() if p.name.startswith(f".{odd.name}.")
               and p.is_dir()]
    assert (left / "nested" / "deep").read_text() == "x"


@pytest.mark.parametrize("content", [b"", b"{", b'{"inputs": 3}', b'["x"]'])
def test_an_unreadable_record_keeps_the_idle_rule(tmp_path: Path, content: bytes) -> None:
    root = tmp_path / "vm-snapshots"
    fresh = _template(root, "a" * 16, None)
    (fresh / "meta.json").write_bytes(content)
    _sweep(root)
    assert fresh.exists()
