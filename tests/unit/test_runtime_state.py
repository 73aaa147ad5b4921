"""A stop asks whether a runtime holds state for its sandbox from that sandbox's own entries
(``_holds_state``); it must agree with the listing the leftover sweep uses (``_state_ids``)
for every runtime's layout, also beside many other sandboxes."""

from pathlib import Path

from dsec.substrates.container.container import _holds_state, _state_ids


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
