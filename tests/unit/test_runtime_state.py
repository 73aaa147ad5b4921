"""The runtimes' records of containers. A stop asks whether a runtime holds state for its
sandbox from that sandbox's own entries (``_holds_state``); it must agree with the listing
the leftover sweep uses (``_state_ids``) for every runtime's layout, also beside many other
sandboxes. Where the records are kept (``state_root``): the edge's disk volume, unless a dsec
from before kept some in the state dir; then there until none is left, so an upgrade loses no
live sandbox's record."""

from pathlib import Path

from dsec.substrates.container.container import (
    RUNTIMES,
    _holds_state,
    _state_ids,
    state_root,
)


def test_one_sandbox_look_agrees_with_the_listing(tmp_path: Path) -> None:
    crun, runsc = tmp_path / "crun", tmp_path / "runsc"
    crun.mkdir()
    runsc.mkdir()
    for i in range(50):
        (crun / f"sb-{i}").mkdir()
    (crun / "sb-file").write_text("")  # a plain file is no crun state
    (runsc / "sb-a_sandbox:sb-a.state").write_text("")
    (runsc / "sb-b_sandbox:sb-b.lock").write_text("")
    (runsc / "sb-c").write_text("")  # neither layout
    for root in (crun, runsc):
        listed = _state_ids(root)
        for sandbox_id in ("sb-0", "sb-49", "sb-50", "sb-file", "sb-a", "sb-b", "sb-c", "sb"):
            assert _holds_state(root, sandbox_id) == (sandbox_id in listed), (root, sandbox_id)


def test_a_missing_runtime_root_holds_nothing(tmp_path: Path) -> None:
    assert not _holds_state(tmp_path / "runc", "sb-0")


def test_a_new_node_keeps_them_on_the_volume(tmp_path: Path) -> None:
    assert state_root(tmp_path / "state" / "runtime", tmp_path / "volume" / "runtime") == \
        tmp_path / "volume" / "runtime"


def test_records_an_earlier_dsec_left_keep_the_earlier_root(tmp_path: Path) -> None:
    earlier = tmp_path / "state" / "runtime"
    for rt in RUNTIMES:
        (earlier / rt).mkdir(parents=True)
    (earlier / "crun" / "sb-e-0123456789ab").mkdir()  # a live sandbox's record
    assert state_root(earlier, tmp_path / "volume" / "runtime") == earlier
    assert (earlier / "crun" / "sb-e-0123456789ab").is_dir()


def test_runsc_records_count_too(tmp_path: Path) -> None:
    earlier = tmp_path / "state" / "runtime"
    (earlier / "runsc").mkdir(parents=True)
    (earlier / "runsc" / "sb-e-1_sandbox:sb-e-1.state").write_text("{}")
    assert state_root(earlier, tmp_path / "volume" / "runtime") == earlier


def test_an_emptied_earlier_root_is_removed(tmp_path: Path) -> None:
    earlier = tmp_path / "state" / "runtime"
    for rt in RUNTIMES:
        (earlier / rt).mkdir(parents=True)
    assert state_root(earlier, tmp_path / "volume" / "runtime") == tmp_path / "volume" / "runtime"
    assert not earlier.exists()


def test_files_no_runtime_made_are_left_alone(tmp_path: Path) -> None:
    """Only emptied dirs go: anything else stays as it is."""
    earlier = tmp_path / "state" / "runtime"
    (earlier / "crun").mkdir(parents=True)
    (earlier / "notes").write_text("an operator's")
    (earlier / "runsc").mkdir()
    (earlier / "runsc" / "runsc.log").write_text("")  # no record of a container
    assert state_root(earlier, tmp_path / "volume" / "runtime") == tmp_path / "volume" / "runtime"
    assert (earlier / "notes").read_text() == "an operator's"
    assert (earlier / "runsc" / "runsc.log").exists() and not (earlier / "crun").exists()
