"""``dsec bench`` as CI runs it: a tiny density series through the real command (a private
server, real containers) answers in every sandbox, leaves nothing behind and exits 0; the
JSON rows carry the figures and no failure. The exec, trajectory and create-parts series run
alone too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dsec_benchmarks.bench import BARE_CGROUP_PARENT
from dsec_benchmarks.bench_create_parts import VARIANTS

from dsec.images.store import ImageStore


def test_density_smoke_reports_no_failures(images: ImageStore, tmp_path: Path) -> None:
    out = tmp_path / "density.json"
    done = subprocess.run([sys.executable, "-m", "dsec", "bench", "--only", "density", "--quick",
                           "--count", "3", "--json", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())}
    assert all(row["failures"] == 0 for row in rows.values())
    assert rows["echo in each of the 3: answers"]["n"] == 3
    assert rows["leftovers after every stop (count, not ms)"]["p50"] == 0
    assert rows["create, 3 kept idle, 64 at a time"]["created"] == 3


def test_exec_and_trajectory_series_run_alone(images: ImageStore, tmp_path: Path) -> None:
    """``--only exec`` and ``--only trajectory``: the two series of the full benchmark alone,
    each row measured with no failure (figures are not asserted)."""
    for series, names in (("exec", {"bare crun exec true", "dsec exec true"}),
                          ("trajectory", {"exec true (no trajectory)",
                                          "exec true, logged in a trajectory"})):
        out = tmp_path / f"{series}.json"
        done = subprocess.run([sys.executable, "-m", "dsec", "bench", "--only", series, "--quick",
                               "--settle", "1000", "--json", str(out)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rows = {row["name"]: row for row in json.loads(out.read_text())}
        assert names <= rows.keys()
        assert all(row["failures"] == 0 and row["n"] > 0 for row in rows.values())
        # every row says the load its series started at (under --settle's bound)
        assert all(0 <= row["load_at_start"] < 1000 for row in rows.values())
    assert rows["exec true, logged in a trajectory"]["p50_ratio_to_baseline"] is not None


def test_soak_smoke_samples_every_curve(images: ImageStore, tmp_path: Path) -> None:
    """``--only soak`` with few cycles: every cycle ran, and every curve (the state database
    and its log apart) was sampled before the first segment and after each of the ten."""
    out = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, "-m", "dsec", "bench", "--only", "soak", "--cycles",
                           "20", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())}
    assert rows["create → run → stop cycle"]["n"] == 20
    assert all(row["failures"] == 0 for row in rows.values())
    curves = [row for row in rows.values() if "at_cycle" in row]
    assert {row["name"] for row in curves} >= {"state database (MB, not ms)",
                                               "state database's log (wal + shm) (MB, not ms)"}
    assert all(row["at_cycle"] == list(range(0, 22, 2)) for row in curves)


def test_count_belongs_to_density_and_throughput() -> None:
    done = subprocess.run([sys.executable, "-m", "dsec", "bench", "--only", "soak", "--count", "3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--count is an option of" in done.stderr


@pytest.mark.parametrize("args", [["--settle", "0"], ["--settle", "-1"], ["--settle", "x"],
                                  ["--only", "fn", "--settle", "2"]])
def test_a_bad_settle_is_refused_before_anything_runs(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "dsec", "bench", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--settle" in done.stderr, done.stderr


def test_create_parts_runs_every_variant_and_leaves_nothing(images: ImageStore,
                                                            tmp_path: Path) -> None:
    """``--only create-parts``: crun with each variant of the config starts its container (a
    variant crun refused would be a failure in its row), and no container, mount, loop disk
    or cgroup of the series outlives it."""
    out = tmp_path / "parts.json"
    done = subprocess.run([sys.executable, "-m", "dsec", "bench", "--only", "create-parts",
                           "--quick", "--json", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == len(VARIANTS)
    assert all(row["failures"] == 0 and row["n"] > 0 for row in rows)
    assert all(row["p50_ratio_to_baseline"] is not None for row in rows[1:])
    assert "/part-" not in Path("/proc/self/mountinfo").read_text()
    assert not [d for base in Path("/sys/fs/cgroup").iterdir()
                for d in (base / BARE_CGROUP_PARENT.strip("/")).glob("part-*")]
