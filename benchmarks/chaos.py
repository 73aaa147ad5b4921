"""Reproduce the chaos counts of docs/RELIABILITY.md: runs tests/test_chaos.py ``--rounds``
times (as root, like the tests) and sums the tallies each run writes to
/tmp/dsec-test-logs/chaos-<fault>.json.

    .venv/bin/python benchmarks/chaos.py [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOGS = Path("/tmp/dsec-test-logs")
COUNTS = ("operations", "results", "hung", "faults_injected", "leak_count")


def one_round() -> tuple[int, list[dict[str, Any]]]:
    for old in LOGS.glob("chaos-*.json"):
        old.unlink()
    code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_chaos.py"], cwd=ROOT).returncode
    return code, [json.loads(p.read_text()) for p in sorted(LOGS.glob("chaos-*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    totals: dict[str, dict[str, Any]] = defaultdict(lambda: {"rounds": 0, "errors": Counter(),
                                                             "untyped": 0, "wrong": 0,
                                                             **{k: 0 for k in COUNTS}})
    failed = 0
    for _ in range(args.rounds):
        code, tallies = one_round()
        failed += code != 0
        for t in tallies:
            total = totals[t["fault"]]
            total["rounds"] += 1
            total["errors"].update(t["errors"])
            total["untyped"] += len(t["untyped"])
            total["wrong"] += len(t["wrong"]) + len(t["success_after_death"])
            for k in COUNTS:
                total[k] += t.get(k, 0)
    print(f"\n{'fault':<22}{'rounds':>7}{'ops':>6}{'results':>8}{'faults':>7}{'hung':>5}"
          f"{'untyped':>8}{'wrong':>6}{'leaks':>6}  typed errors")
    for fault, t in sorted(totals.items()):
        errors = ", ".join(f"{k} {v}" for k, v in sorted(t["errors"].items()))
        print(f"{fault:<22}{t['rounds']:>7}{t['operations']:>6}{t['results']:>8}"
              f"{t['faults_injected']:>7}{t['hung']:>5}{t['untyped']:>8}{t['wrong']:>6}"
              f"{t['leak_count']:>6}  {errors}")
    print(f"test runs failed: {failed} of {args.rounds}")
    if args.json:
        args.json.write_text(json.dumps({"rounds_failed": failed, "faults": totals}, indent=2,
                                        default=dict))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
