"""Run inside a harbor venv (Python >= 3.12, ``tests/test_integrations.py``): harbor's own
Trial runs a small task (oracle agent, verifier) with ``--env``'s import path
``dsec.integrations.harbor:DsecEnvironment``; harbor's factory loads the class the same way
for a task's environment that goes start -> exec -> uploads/downloads -> network phases ->
stop; then a sandbox plants traps in directories harbor downloads. What each step observed is
printed as JSON (``{"raised": name, ...}`` for an exception).

Argument: a scratch directory. The server and key come from ``DSEC_URL``/``DSEC_API_KEY``;
dsec itself from ``PYTHONPATH``."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment
from harbor.environments.factory import EnvironmentFactory
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.config import AgentConfig, TaskConfig, TrialConfig
from harbor.models.trial.config import EnvironmentConfig as TrialEnvironment
from harbor.models.trial.paths import TrialPaths
from harbor.trial.trial import Trial

IMPORT_PATH = "dsec.integrations.harbor:DsecEnvironment"
FLOOD = 64 << 20


def make(scratch: Path, name: str, config: EnvironmentConfig, **kwargs: Any) -> Any:
    env_dir = scratch / name / "environment"
    env_dir.mkdir(parents=True)
    trial = TrialPaths(trial_dir=scratch / name / "trial")
    trial.mkdir()
    return EnvironmentFactory.create_environment_from_import_path(
        IMPORT_PATH, environment_dir=env_dir, environment_name=name,
        session_id=f"{name}__dsec__env", trial_paths=trial, task_env_config=config, **kwargs)


def raised(exc: BaseException) -> dict[str, Any]:
    return {"raised": type(exc).__name__, "message": str(exc)}


async def lifecycle(scratch: Path, out: dict[str, Any]) -> None:
    env = make(scratch, "hello", EnvironmentConfig(docker_image="debian-minbase", cpus=1,
                                                   memory_mb=256, workdir="/app",
                                                   env={"TASK_VAR": "task"}),
               network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK),
               phase_network_policies=[
                   NetworkPolicy(network_mode=NetworkMode.NO_NETWORK),
                   NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["10.9.8.7"])])
    out["type"] = type(env).__module__ + ":" + type(env).__name__
    await env.start(force_build=False)
    try:
        await lifecycle_steps(env, scratch, out)
    finally:
        await env.stop(delete=True)
    out["stop_again"] = await env.stop(delete=True)  # a second stop is harmless
    try:
        await env.exec("true")
        out["exec_after_stop"] = "ran"
    except Exception as exc:  # noqa: BLE001 - what the user sees
        out["exec_after_stop"] = raised(exc)


async def lifecycle_steps(env: Any, scratch: Path, out: dict[str, Any]) -> None:
    sandbox = env.sandbox
    out["sandbox_network"] = str(sandbox.info.network)
    r = await env.exec("mkdir -p /app && pwd && echo $TASK_VAR $EXTRA && echo err >&2; exit 4",
                       env={"EXTRA": "x"}, cwd="/")
    out["exec"] = [r.stdout, r.stderr, r.return_code]
    chunks: list[tuple[str, str]] = []

    async def collect(text: str, stream: str) -> None:
        chunks.append((stream, text))

    with env.scoped_output_callback(collect):  # how a trial streams a phase's logs
        r = await env.exec("for i in 1 2 3; do echo $i; sleep 0.3; done; printf '\\xc3' >&2; "
                           "sleep 0.3; printf '\\xa9\\n\\xc3' >&2")
    out["streamed"] = {"chunks": chunks, "result": [r.stdout, r.stderr]}
    r = await env.exec("pwd")  # the task's workdir
    out["workdir"] = r.stdout
    try:
        await env.exec("sleep 30", timeout_sec=2)
        out["timeout"] = "returned"
    except Exception as exc:  # noqa: BLE001
        out["timeout"] = raised(exc) | {"timeout_error": isinstance(exc, TimeoutError)}
    r = await env.exec(f"head -c {FLOOD} /dev/zero | tr '\\0' a")
    out["flood"] = [len(r.stdout or ""), r.return_code]
    await env.exec("useradd -m agent")
    r = await env.exec("id -un; echo $HOME $TASK_VAR; pwd; touch /root/x", user="agent",
                       cwd="/tmp")
    out["other_user"] = [r.stdout, r.stderr.strip().endswith("Permission denied"), r.return_code]
    with env.with_default_user("agent"):  # how a trial runs its agent as the task's user
        out["default_user"] = (await env.exec("id -un")).stdout
    try:
        await env.exec("id -u", user=1000)
        out["uid_user"] = "ran"
    except Exception as exc:  # noqa: BLE001
        out["uid_user"] = raised(exc)

    local = scratch / "local"
    (local / "tests" / "sub").mkdir(parents=True)
    (local / "tests" / "test.sh").write_text("#!/bin/bash\necho verifying\n")
    (local / "tests" / "test.sh").chmod(0o755)
    (local / "tests" / "sub" / "data.txt").write_text("nested\n")
    await env.upload_dir(local / "tests", "/tests")
    await env.upload_file(local / "tests" / "test.sh", "/solution/deep/solve.sh")
    r = await env.exec("/tests/test.sh && cat /tests/sub/data.txt && /solution/deep/solve.sh")
    out["uploaded"] = [r.stdout, r.return_code]
    await env.exec("mkdir -p /logs/verifier/n && echo 1 > /logs/verifier/reward.txt "
                   "&& echo deep > /logs/verifier/n/x.txt")
    await env.download_file("/logs/verifier/reward.txt", scratch / "dl" / "file" / "reward.txt")
    await env.download_dir("/logs/verifier", scratch / "dl" / "dir")
    out["downloaded"] = [(scratch / "dl" / "file" / "reward.txt").read_text(),
                         sorted(str(p.relative_to(scratch / "dl" / "dir"))
                                for p in (scratch / "dl" / "dir").rglob("*"))]
    out["is_dir"] = [await env.is_dir("/tests"), await env.is_file("/tests/test.sh"),
                     await env.is_dir("/nope")]

    await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.ALLOWLIST,
                                               allowed_hosts=["10.9.8.7"]))
    out["network_verifier"] = (await sandbox.refresh()).network.model_dump()
    await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.PUBLIC))
    out["network_public"] = (await sandbox.refresh()).network.allow
    # harbor's "public" is the internet, not the host: the sandbox's gateway (the host end of
    # its link) is refused by the policy; the control allows it by name and gets an answer
    gateway = (await env.exec(GATEWAY)).stdout
    out["public_to_host"] = (await env.exec(probe(gateway))).stderr
    await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.ALLOWLIST,
                                               allowed_hosts=[gateway]))
    out["allowed_to_host"] = (await env.exec(probe(gateway))).stderr
    await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))
    out["network_back"] = str((await sandbox.refresh()).network)


# the default route's gateway, from /proc/net/route (little-endian hex)
GATEWAY = ("gw=$(awk '$2 == \"00000000\" {print $3}' /proc/net/route); "
           "printf '%d.%d.%d.%d' 0x${gw:6:2} 0x${gw:4:2} 0x${gw:2:2} 0x${gw:0:2}")


def probe(host: str) -> str:
    """A TCP connection to port 9 of ``host``: refused by a closed port, or no route."""
    return f"timeout 5 bash -c 'echo > /dev/tcp/{host}/9'"


async def traps(scratch: Path, out: dict[str, Any]) -> None:
    """The sandbox is the agent's: it leaves symlinks and a crafted tar in the directory the
    trial downloads. Nothing may land outside the destination."""
    env = make(scratch, "traps", EnvironmentConfig(docker_image="debian-minbase"),
               network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))
    outside = scratch / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("untouched\n")
    await env.start(force_build=False)
    try:
        await env.exec(
            f"mkdir -p /logs/agent && cd /logs/agent && ln -s {outside} escape "
            f"&& ln -s {outside}/victim.txt victim && ln -s /etc/shadow shadow "
            "&& echo pwned > plain.txt")
        dest = scratch / "dl-traps"
        try:
            await env.download_dir("/logs/agent", dest)
            out["trap_symlinks"] = sorted(p.name for p in dest.iterdir())
        except Exception as exc:  # noqa: BLE001
            out["trap_symlinks"] = raised(exc)
        # the agent's process writes after the download: through the symlink it made
        try:
            (dest / "victim").write_text("overwritten\n")
        except OSError:
            pass
        # a download whose source the agent replaced by a symlink out of the sandbox's tree
        await env.exec(f"rm -rf /logs/agent && ln -s {outside} /logs/agent")
        try:
            await env.download_dir("/logs/agent", scratch / "dl-traps2")
            out["trap_dir_link"] = sorted(p.name for p in (scratch / "dl-traps2").rglob("*"))
        except Exception as exc:  # noqa: BLE001
            out["trap_dir_link"] = raised(exc)
        await filtered(env, scratch, out)
    finally:
        await env.stop(delete=True)
    out["outside_after"] = sorted(p.name for p in outside.iterdir())
    out["victim_after"] = (outside / "victim.txt").read_text()


async def filtered(env: Any, scratch: Path, out: dict[str, Any]) -> None:
    """harbor's filtered downloads (agent logs with include/exclude, artifacts with excludes),
    from a sandbox whose image's tar has been replaced by one that hands over a forged
    archive: the files downloaded are the sandbox's real ones, filtered."""
    forged = scratch / "forged.tar.gz"
    with tarfile.open(forged, "w:gz") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = len(b"forged\n")
        tar.addfile(info, io.BytesIO(b"forged\n"))
    await env.upload_file(forged, "/forged.tar.gz")
    await env.exec("mkdir -p /logs/artifacts/node_modules && cd /logs/artifacts && echo real > a.txt "
                   "&& echo log > b.log && echo js > node_modules/x.js && printf '#!/bin/sh\n"
                   "cp /forged.tar.gz \"$2\"\n' > /tmp/tar && chmod +x /tmp/tar "
                   "&& for t in /bin/tar /usr/bin/tar; do [ -e $t ] && cp /tmp/tar $t; done; true")
    excluded = scratch / "dl-excluded"
    await env.download_dir_with_exclusions(source_dir="/logs/artifacts", target_dir=excluded,
                                           exclude=["*.log", "node_modules"])
    chosen = scratch / "dl-filtered"
    await env.download_dir_filtered(source_dir="/logs/artifacts", target_dir=chosen,
                                    include=["*.txt", "*.log"], exclude=["b.log"])
    # the control: harbor's own implementation takes the forged archive
    control = scratch / "dl-control"
    await BaseEnvironment.download_dir_with_exclusions(env, source_dir="/logs/artifacts",
                                                       target_dir=control, exclude=["*.log"])
    out["filtered"] = {str(d.name): {p.relative_to(d).as_posix(): p.read_text()
                                     for p in sorted(d.rglob("*")) if p.is_file()}
                       for d in (excluded, chosen, control)}
    await env.exec("ln -s /etc/shadow /logs/artifacts/shadow")
    try:
        await env.download_dir_filtered(source_dir="/logs/artifacts", target_dir=chosen,
                                        include=["*.txt"])
        out["filtered_trap"] = "downloaded"
    except Exception as exc:  # noqa: BLE001
        out["filtered_trap"] = raised(exc)


async def refusals(scratch: Path, out: dict[str, Any]) -> None:
    dockerfile_task = scratch / "built" / "environment"
    dockerfile_task.mkdir(parents=True)
    (dockerfile_task / "Dockerfile").write_text("FROM debian:bookworm\n")
    trial = TrialPaths(trial_dir=scratch / "built" / "trial")
    try:
        EnvironmentFactory.create_environment_from_import_path(
            IMPORT_PATH, environment_dir=dockerfile_task, environment_name="built",
            session_id="built__dsec__env", trial_paths=trial, task_env_config=EnvironmentConfig())
        out["dockerfile"] = "accepted"
    except Exception as exc:  # noqa: BLE001
        out["dockerfile"] = raised(exc)
    try:
        make(scratch, "badopt", EnvironmentConfig(docker_image="debian-minbase"), nope=1)
        out["bad_option"] = "accepted"
    except Exception as exc:  # noqa: BLE001
        out["bad_option"] = raised(exc)
    try:
        make(scratch, "wild", EnvironmentConfig(docker_image="debian-minbase"),
             network_policy=NetworkPolicy(network_mode=NetworkMode.ALLOWLIST,
                                          allowed_hosts=["*.example.com"]))
        out["wildcard"] = "accepted"
    except Exception as exc:  # noqa: BLE001
        out["wildcard"] = raised(exc)


TASK_TOML = """schema_version = "1.4"
[agent]
timeout_sec = 120.0
network_mode = "no-network"
[verifier]
timeout_sec = 120.0
network_mode = "allowlist"
allowed_hosts = ["10.9.8.7"]
[environment]
docker_image = "debian-minbase"
workdir = "/app"
network_mode = "no-network"
"""
# each phase also counts the sandbox's IPv4 routes: none without network, some with a policy
ROUTES = "$(($(wc -l < /proc/net/route) - 1))"
# environment/input.txt: loose files of a docker_image task, uploaded into the workdir at start
SOLVE = f"#!/bin/bash\ncp input.txt /app/answer.txt\necho {ROUTES} > /logs/agent/routes.txt\n"
TEST = ("#!/bin/bash\nif [ \"$(cat /app/answer.txt)\" = 42 ]; then echo 1; else echo 0; fi "
        f"> /logs/verifier/reward.txt\necho {ROUTES} > /logs/verifier/routes.txt\n")


async def trial(scratch: Path, out: dict[str, Any]) -> None:
    """A whole harbor trial: its Trial drives the environment (start, the oracle agent's
    upload of solution/ and run of solve.sh, the verifier's upload of tests/, test.sh, the
    download of its logs and reward, stop), with the task's network policy per phase."""
    task = scratch / "task" / "answer"
    for sub in ("environment", "solution", "tests"):
        (task / sub).mkdir(parents=True)
    (task / "task.toml").write_text(TASK_TOML)
    (task / "environment" / "input.txt").write_text("42\n")
    (task / "instruction.md").write_text("Write 42 to /app/answer.txt.\n")
    (task / "solution" / "solve.sh").write_text(SOLVE)
    (task / "tests" / "test.sh").write_text(TEST)
    config = TrialConfig(task=TaskConfig(path=task), trials_dir=scratch / "trials",
                         trial_name="answer__dsec", agent=AgentConfig(name="oracle"),
                         environment=TrialEnvironment(import_path=IMPORT_PATH,
                                                            kwargs={"ttl_s": 600}))
    result = await (await Trial.create(config)).run()
    trial_dir = scratch / "trials" / "answer__dsec"
    out["trial"] = {
        "exception": None if result.exception_info is None else result.exception_info.model_dump(),
        "rewards": None if result.verifier_result is None else result.verifier_result.rewards,
        "routes": {phase: (trial_dir / phase / "routes.txt").read_text()
                   for phase in ("agent", "verifier")}}


async def main() -> None:
    scratch = Path(sys.argv[1])
    out: dict[str, Any] = {}
    await trial(scratch, out)
    await lifecycle(scratch, out)
    await traps(scratch, out)
    await refusals(scratch, out)
    json.dump(out, sys.stdout, default=str)


if __name__ == "__main__":
    asyncio.run(main())
