"""Run inside a harbor venv with the e2b SDK (``tests/test_compat_e2b_templates.py``): harbor's
own E2B environment (``harbor.environments.e2b:E2BEnvironment``, unmodified) against dsec's E2B
front. It builds its template from a task's Dockerfile (RUN and COPY steps, and harbor's own
RUN steps that record the image's env and user), starts a sandbox of it, runs a command,
stops; then harbor's own Trial (oracle agent, verifier) runs a task whose environment is a
Dockerfile with a RUN step, on that environment. What each step observed is printed as JSON
(``{"raised": name, ...}``).

Argument: a scratch directory. E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY point at dsec."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from harbor.environments.factory import EnvironmentFactory
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.config import AgentConfig, TaskConfig, TrialConfig
from harbor.models.trial.config import EnvironmentConfig as TrialEnvironment
from harbor.models.trial.paths import TrialPaths
from harbor.trial.trial import Trial

IMPORT_PATH = "harbor.environments.e2b:E2BEnvironment"
DOCKERFILE = """\
FROM debian-minbase
ENV TASK_HOME=/app
RUN mkdir -p /app && echo "built by a RUN step" > /app/built.txt
COPY task.txt /app/task.txt
WORKDIR /app
"""


TASK_TOML = """schema_version = "1.4"
[agent]
timeout_sec = 120.0
[verifier]
timeout_sec = 120.0
[environment]
workdir = "/app"
"""
TASK_DOCKERFILE = "FROM debian-minbase\nRUN mkdir -p /app && echo 42 > /app/input.txt\nWORKDIR /app\n"
SOLVE = "#!/bin/bash\ncp /app/input.txt /app/answer.txt\n"
TEST = ('#!/bin/bash\nif [ "$(cat /app/answer.txt)" = 42 ]; then echo 1; else echo 0; fi '
        "> /logs/verifier/reward.txt\n")


async def trial(scratch: Path) -> dict[str, Any]:
    """harbor's Trial on the E2B environment: template built from the task's Dockerfile, the
    oracle agent's solve.sh, the verifier's test.sh and the download of its reward."""
    task = scratch / "task" / f"answer-{os.urandom(3).hex()}"
    for sub in ("environment", "solution", "tests"):
        (task / sub).mkdir(parents=True)
    (task / "task.toml").write_text(TASK_TOML)
    (task / "environment" / "Dockerfile").write_text(TASK_DOCKERFILE)
    (task / "instruction.md").write_text("Copy /app/input.txt to /app/answer.txt.\n")
    (task / "solution" / "solve.sh").write_text(SOLVE)
    (task / "tests" / "test.sh").write_text(TEST)
    config = TrialConfig(task=TaskConfig(path=task), trials_dir=scratch / "trials",
                         trial_name="answer__e2b", agent=AgentConfig(name="oracle"),
                         environment=TrialEnvironment(import_path=IMPORT_PATH))
    result = await (await Trial.create(config)).run()
    return {"exception": None if result.exception_info is None
            else result.exception_info.model_dump(mode="json"),
            "rewards": None if result.verifier_result is None else result.verifier_result.rewards}


async def main(scratch: Path) -> dict[str, Any]:
    name = f"hb-e2b-{os.urandom(3).hex()}"
    env_dir = scratch / name / "environment"
    env_dir.mkdir(parents=True)
    (env_dir / "Dockerfile").write_text(DOCKERFILE)
    (env_dir / "task.txt").write_text(f"task {name}\n")
    paths = TrialPaths(trial_dir=scratch / name / "trial")
    paths.mkdir()
    env = EnvironmentFactory.create_environment_from_import_path(
        IMPORT_PATH, environment_dir=env_dir, environment_name=name,
        session_id=f"{name}__e2b", trial_paths=paths,
        task_env_config=EnvironmentConfig(cpus=1, memory_mb=512, workdir="/app"))
    out: dict[str, Any] = {"task": name}
    try:
        await env.start(force_build=False)
    except Exception as exc:  # noqa: BLE001 - what the user sees
        return {**out, "start": {"raised": type(exc).__name__, "message": str(exc)[-3000:]}}
    try:
        r = await env.exec("cat built.txt task.txt; pwd; echo $TASK_HOME")
        out["exec"] = [r.stdout, r.stderr, r.return_code]
    finally:
        await env.stop(delete=True)
    out["trial"] = await trial(scratch)
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1])))), flush=True)
    os._exit(0)  # the e2b SDK's native teardown at exit aborts now and then (compat_e2b_driver.py)
