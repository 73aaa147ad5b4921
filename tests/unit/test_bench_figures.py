"""The pure parts of ``dsec bench``'s density series and of its verdict: what a host figure
per sandbox is, what counts as a leftover, that failures (never figures) fail the run, and when
``--settle`` starts a series."""

from typing import Callable

import pytest
from dsec_benchmarks.bench import Sample, failed, start_load
from dsec_benchmarks.bench_density import (
    _leftovers,
    by_tenth,
    excess,
    per_sandbox_mb,
)
from dsec_benchmarks.server_host import meminfo_kb
from rich.console import Console

MEMINFO = "MemTotal:       24684012 kB\nMemFree:        15919748 kB\nMemAvailable:   20578644 kB\n"


def test_meminfo_field_in_kb() -> None:
    assert meminfo_kb(MEMINFO, "MemAvailable") == 20578644
    assert meminfo_kb(MEMINFO, "MemTotal") == 24684012


@pytest.mark.parametrize("field", ["Cached", "Mem"])
def test_meminfo_field_missing_or_only_a_prefix_is_an_error(field: str) -> None:
    with pytest.raises(ValueError):
        meminfo_kb(MEMINFO, field)


def test_per_sandbox_mb() -> None:
    assert per_sandbox_mb(2_000_000, 1_000_000, 1000) == 1000 * 1024 / 1e6
    assert per_sandbox_mb(1_000_000, 1_000_000, 0) == 0.0  # nothing made: no division by zero


def test_excess_counts_only_what_grew() -> None:
    before = {"mounts": 3, "loops": 1, "cgroups": 0}
    assert excess(before, {"mounts": 3, "loops": 0, "cgroups": 2, "rows": 1}) == \
        {"cgroups": 2, "rows": 1}
    assert excess(before, dict(before)) == {}


def test_leftovers_are_failures_and_name_their_kind() -> None:
    clean = _leftovers({})
    assert clean.failures == 0 and not failed([clean])
    dirty = _leftovers({"sandbox cgroups": 2, "mounts under the state dir": 1})
    assert dirty.failures == 3 and failed([clean, dirty]) == [dirty]
    assert dirty.errors == ["2 sandbox cgroups left", "1 mounts under the state dir left"]
    assert dirty.row()["sandbox cgroups"] == 2


def test_a_slow_figure_never_fails_a_series_a_failure_does() -> None:
    slow = Sample("create", [1e9, 2e9])
    broken = Sample("exec", [1.0])
    broken.add([RuntimeError("did not answer")])
    assert failed([slow, broken]) == [broken]


def test_rate_by_tenth_follows_the_calls_as_they_ended() -> None:
    ends = [0.1 * i for i in range(1, 11)] + [1.0 + 1.0 * i for i in range(1, 11)]
    rates = by_tenth(list(reversed(ends)), 0.0)  # the order they were noted in does not matter
    assert rates[:5] == pytest.approx([10.0] * 5) and rates[5:] == pytest.approx([1.0] * 5)
    assert by_tenth([1.0, 2.0], 0.0) == [1.0, 1.0]  # fewer calls than tenths: one rate each
    assert by_tenth([], 0.0) == []


def _loads(*values: float) -> Callable[[], float]:
    """A load average that reads ``values`` in turn, then stays at the last."""
    left = list(values)
    return lambda: left.pop(0) if len(left) > 1 else left[0]


async def test_a_series_starts_once_the_load_falls_under_settle() -> None:
    read = _loads(5.0, 3.2, 2.1, 1.4, 0.9)
    assert await start_load(Console(quiet=True), 2.0, max_s=60, poll_s=0, read=read) == 1.4


async def test_without_settle_a_series_starts_at_once_at_any_load() -> None:
    read = _loads(9.0, 0.5)
    assert await start_load(Console(quiet=True), None, read=read) == 9.0


async def test_a_load_that_never_falls_starts_the_series_after_the_longest_wait() -> None:
    assert await start_load(Console(quiet=True), 2.0, max_s=0.05, poll_s=0.01,
                            read=_loads(7.5)) == 7.5
