"""The OOM count a death is described with: the kernel bumps ``oom`` before it kills and
``oom_kill`` after, so a reader woken by the death must not see "no OOM"."""

from dsec.substrates.host.cgroups import OOM_KEYS, oom_count, oom_kills


def test_a_kill_still_in_flight_counts() -> None:
    events = "low 0\nhigh 0\nmax 12\noom 1\noom_kill 0\noom_group_kill 0\n"
    assert oom_count(events, OOM_KEYS["memory.events"]) == 1


def test_no_oom_is_zero_and_a_finished_kill_counts_once() -> None:
    assert oom_count("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n", OOM_KEYS["memory.events"]) == 0
    assert oom_count("oom 2\noom_kill 2\n", OOM_KEYS["memory.events"]) == 2


def test_cgroup_v1_reads_its_only_counter() -> None:
    assert oom_count("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n", OOM_KEYS["memory.oom_control"]) == 3


def test_a_sandbox_whose_cgroup_is_gone_counts_no_kill() -> None:
    """Read with one ``os.read`` of the real cgroup tree: a sandbox removed meanwhile (or a
    name that never existed) is no OOM, not an error on the exec's path."""
    assert oom_kills("dsec-no-such-parent", "sb-gone") == 0
