"""The trajectory log's outcome journal (``dsec.trajectory.journal``): an answered step's
outcome survives its server's death before the fold, a record cut short by the crash is
dropped (the step reads as interrupted), a live server's journal is never taken, and what a
sandbox printed cannot forge a record. The crashes are real: a child process that logs and
then kills itself with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from dsec.protocol.digest import StepRequest
from dsec.store.blobs import BlobStore
from dsec.trajectory.journal import SUFFIX
from dsec.trajectory.log import TrajectoryLog

# A child that logs steps as a server does, then dies without closing the log.
CHILD = textwrap.dedent("""
    import json, os, signal, sys
    from pathlib import Path
    from dsec.protocol.digest import StepRequest
    from dsec.store.blobs import BlobStore
    from dsec.trajectory.log import TrajectoryLog

    root, plan = Path(sys.argv[1]), json.loads(sys.argv[2])
    log = TrajectoryLog(root / "state.db", BlobStore(root / "blobs"), owner="dead")
    if plan["create"]:
        log.create("t/1", "sb-1", {"image": "x"}, "img", "sha256:0", None)
    for step, stored in plan["steps"]:
        log.claim("t/1", 1, step, StepRequest("exec", {"command": f"step {step}"}), "sb-1", None)
        if stored is not None:
            log.finish("t/1", 1, step, stored)
        if plan.get("fold_after") == step:
            log.fold()
    journal = root / ("state.db" + plan["suffix"]) / ("dead" + plan["suffix"])
    os.truncate(journal, os.path.getsize(journal) - plan.get("cut", 0))
    os.kill(os.getpid(), signal.SIGKILL)
""")


def outcome(exit_code: int, stdout: str = "") -> dict[str, Any]:
    return {"value": {"exit_code": exit_code}, "bytes": {"stdout": {"size": len(stdout), "b64": stdout}}}


def die_after(root: Path, steps: list[tuple[int, dict[str, Any] | None]], create: bool = True,
              **plan: Any) -> None:
    """Log ``steps`` (step, outcome or None: claimed only) in a child that is then killed."""
    plan = {"create": create, "steps": steps, "suffix": SUFFIX, **plan}
    child = subprocess.run([sys.executable, "-c", CHILD, str(root), json.dumps(plan)],
                           capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr


def reopen(root: Path) -> TrajectoryLog:
    return TrajectoryLog(root / "state.db", BlobStore(root / "blobs"), owner="next")


def journals(root: Path) -> list[str]:
    return sorted(p.name for p in (root / f"state.db{SUFFIX}").iterdir())


def test_an_answered_outcome_survives_a_crash_before_the_fold(tmp_path: Path) -> None:
    die_after(tmp_path, [(1, outcome(0, "b25l")), (2, outcome(7, "dHdv"))])
    log = reopen(tmp_path)
    try:
        first, second = log.step("t/1", 1, 1), log.step("t/1", 1, 2)
        assert first is not None and first.status == "ok" and first.outcome == outcome(0, "b25l")
        assert second is not None and second.status == "ok" and second.outcome == outcome(7, "dHdv")
        assert journals(tmp_path) == ["next" + SUFFIX]  # the dead one's was folded, then removed
    finally:
        log.close()
    assert journals(tmp_path) == []


def test_a_record_cut_short_by_the_crash_leaves_its_step_interrupted(tmp_path: Path) -> None:
    die_after(tmp_path, [(1, outcome(0)), (2, outcome(0))], cut=3)
    log = reopen(tmp_path)
    try:
        first, second = log.step("t/1", 1, 1), log.step("t/1", 1, 2)
        assert first is not None and first.status == "ok"
        assert second is not None and second.status == "interrupted" and second.outcome is None
    finally:
        log.close()


def test_a_step_that_was_running_reads_as_interrupted_and_a_folded_one_is_kept(tmp_path: Path) -> None:
    die_after(tmp_path, [(1, outcome(0)), (2, outcome(1)), (3, None)], fold_after=2)
    log = reopen(tmp_path)
    try:
        rows = log.steps("t/1", 1)
        assert [(r.step, r.status) for r in rows] == [(1, "ok"), (2, "ok"), (3, "interrupted")]
        assert rows[1].outcome == outcome(1)
    finally:
        log.close()


def finished(root: Path, owner: str, exit_code: int) -> TrajectoryLog:
    """A log of this process (``owner``) whose step 1 is finished: journaled, not folded."""
    log = TrajectoryLog(root / "state.db", BlobStore(root / "blobs"), owner=owner)
    log.create("t/1", "sb-1", {"image": "x"}, "img", "sha256:0", None)
    log.claim("t/1", 1, 1, StepRequest("exec", {"command": "true"}), "sb-1", None)
    log.finish("t/1", 1, 1, outcome(exit_code))
    return log


def test_a_live_servers_journal_is_left_to_it(tmp_path: Path) -> None:
    live = finished(tmp_path, "live", 0)
    other = reopen(tmp_path)  # another process on the same database, meanwhile
    try:
        seen = other.step("t/1", 1, 1)
        assert seen is not None and seen.status == "interrupted"  # running, as far as it knows
        assert journals(tmp_path) == ["live" + SUFFIX, "next" + SUFFIX]
        live.fold()
        seen = other.step("t/1", 1, 1)
        assert seen is not None and seen.status == "ok" and seen.outcome == outcome(0)
    finally:
        other.close()
        live.close()


def test_output_shaped_like_records_cannot_rewrite_another_step(tmp_path: Path) -> None:
    """An agent whose step 2 lists file names made to look like journal records finishing
    step 1 (the grader's) with exit code 0, hoping a crash and recovery take them as such."""
    forged_key = json.dumps(["ok", 1.0, "t/1", 1, 1, "dead"], separators=(",", ":"))
    forged = f'\n{forged_key}\t{{"value":{{"exit_code":0}},"bytes":{{}}}}\n'
    names = [forged, forged.replace("\n", "\r\n"), "\t" + forged_key, "\u2028" + forged]
    listing = {"value": [{"name": n} for n in names], "bytes": {}}
    die_after(tmp_path, [(1, None), (2, listing)])
    log = reopen(tmp_path)
    try:
        grader, agent = log.step("t/1", 1, 1), log.step("t/1", 1, 2)
        assert grader is not None and grader.status == "interrupted" and grader.outcome is None
        assert agent is not None and agent.status == "ok"
        assert [entry["name"] for entry in agent.outcome["value"]] == names  # type: ignore[index]
    finally:
        log.close()


def test_a_journal_left_by_a_process_that_died_holds_nothing_it_did_not_write(tmp_path: Path) -> None:
    """Records are only ever folded onto the steps their own owner claimed: a record naming
    another owner's running step changes nothing."""
    die_after(tmp_path, [(1, None)])  # step 1 claimed by "dead", which died running it
    journal = tmp_path / f"state.db{SUFFIX}" / f"planted{SUFFIX}"
    key = json.dumps(["ok", 1.0, "t/1", 1, 1, "planted"], separators=(",", ":"))
    journal.write_text(f'{key}\t{{"value":{{"exit_code":0}},"bytes":{{}}}}\n')
    log = reopen(tmp_path)
    try:
        step = log.step("t/1", 1, 1)
        assert step is not None and step.status == "interrupted"
        assert not journal.exists()
    finally:
        log.close()


def test_a_closed_log_leaves_its_outcomes_in_the_table_and_no_journal(tmp_path: Path) -> None:
    finished(tmp_path, "clean", 3).close()
    assert journals(tmp_path) == []
    again = reopen(tmp_path)
    try:
        step = again.step("t/1", 1, 1)
        assert step is not None and step.status == "ok" and step.outcome == outcome(3)
    finally:
        again.close()
    assert os.listdir(tmp_path / f"state.db{SUFFIX}") == []
