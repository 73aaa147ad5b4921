"""The disk volume's pure decisions: where an edge's images go for each setting, and when a
create must be refused for room (substrates/host/volume.py)."""

from __future__ import annotations

from pathlib import Path

from dsec.config import Settings
from dsec.substrates.host.volume import RESERVE_BYTES, DiskVolume, Room, refusal

MiB = 1 << 20


def test_each_setting_names_its_root() -> None:
    state = Path("/var/lib/dsec/r0123abcd")
    assert DiskVolume(state, "r0123abcd").root == state / "volume"
    assert DiskVolume(state, "r0123abcd", "off").root == state
    assert DiskVolume(state, "r0123abcd", "/mnt/xfs").root == Path("/mnt/xfs/r0123abcd")
    assert DiskVolume(state, "e1").file == state / "volume.xfs"


def test_a_disk_is_refused_unless_it_fits_with_the_reserve_on_every_file_system() -> None:
    volume = Room("disk volume", Path("/v"), 10_000 * MiB)
    host = Room("file system under the disk volume", Path("/s"), 2_000 * MiB)
    assert refusal([volume, host], 1024 * MiB) is None
    assert refusal([volume, host], 2_000 * MiB - RESERVE_BYTES) is None  # exactly fits
    why = refusal([volume, host], 2_000 * MiB - RESERVE_BYTES + 1)
    assert why is not None and why.startswith("the file system under the disk volume (/s)")
    why = refusal([Room("disk volume", Path("/v"), 0), host], 16 * MiB)
    assert why is not None and "disk volume (/v) has 0 MiB free" in why
    assert refusal([], 1 << 40) is None


def test_the_settings_read_the_volume_options() -> None:
    settings = Settings.load({"DSEC_DISK_VOLUME": "off", "DSEC_DISK_VOLUME_GB": "64"})
    assert (settings.disk_volume, settings.disk_volume_gb) == ("off", 64)
    assert Settings.load({}).disk_volume == "auto"
