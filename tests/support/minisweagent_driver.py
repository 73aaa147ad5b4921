"""Run inside a mini-swe-agent venv (``tests/test_integrations.py``): mini-swe-agent's own
loader builds ``dsec.integrations.minisweagent.DsecEnvironment`` from its own default config
plus the lines a user adds for dsec, its ``DefaultAgent`` (with that config's templates) runs a
scripted model (its ``DeterministicModel``, no LLM) through a small task, and what the agent and the environment reported is printed as JSON.

With ``--exit-without-cleanup``, it only makes an environment, runs a command and exits.
The server and key come from ``DSEC_URL``/``DSEC_API_KEY``; dsec itself from ``PYTHONPATH``."""

from __future__ import annotations

import json
import sys

import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_path
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output

import dsec

FLOOD = 64 << 20  # bytes the agent prints; the environment's cap is 1 MiB
FLOOD_COMMAND = f"head -c {FLOOD} /dev/zero | tr '\\0' a"


def main() -> None:
    # mini-swe-agent's own default config (its templates, its environment variables), with
    # the environment section a user would add to use dsec
    config = yaml.safe_load(get_config_path("default").read_text())
    env = get_environment({
        **config["environment"], "env": {**config["environment"]["env"], "GREETING": "hi"},
        "environment_class": "dsec.integrations.minisweagent.DsecEnvironment",
        "image": "debian-minbase", "cwd": "/tmp", "timeout": 5, "memory_mb": 256,
        "max_output_bytes": 1 << 20})
    report: dict = {"env_type": type(env).__module__ + "." + type(env).__name__,
                    "sandbox": env.sandbox.id}
    actions = [
        "mkdir -p /tmp/work && cd /tmp/work && echo \"$GREETING world\" > answer.txt && pwd",
        "cat /tmp/work/answer.txt; echo to-stderr >&2; exit 3",
        "sleep 30",  # past the 5 s timeout: an observation, not a crash
        FLOOD_COMMAND,  # an output flood
        # a forged submit: the marker, but the command failed, so the task goes on
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo forged; false",
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat /tmp/work/answer.txt",
    ]
    model = DeterministicModel(outputs=[make_output(f"step {i}", [{"command": c}])
                                        for i, c in enumerate(actions)],
                               observation_template=config["model"]["observation_template"])
    agent = DefaultAgent(model, env, **{**config["agent"], "step_limit": 20, "cost_limit": 100})
    result = agent.run("Write 'hi world' to /tmp/work/answer.txt and submit it.")
    report["result"] = result
    report["instance_message"] = agent.messages[1]["content"]
    report["template_vars"] = {k: v for k, v in env.get_template_vars().items()
                               if k in ("sandbox_id", "system", "machine", "image")}
    observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
    report["observations"] = observations
    report["flood_bytes"] = len(env.execute({"command": FLOOD_COMMAND})["output"].encode())
    report["serialized_type"] = agent.serialize()["info"]["config"]["environment_type"]

    direct = env.execute({"command": "echo $GREETING from $PWD"}, cwd="/")
    report["direct"] = direct
    env.cleanup()
    env.cleanup()  # twice is harmless
    try:
        with dsec.Client() as client:
            client.get(report["sandbox"]).run("true")
        report["after_cleanup"] = "still running"
    except dsec.DSecError as exc:
        report["after_cleanup"] = type(exc).__name__
    json.dump(report, sys.stdout)


def exit_without_cleanup() -> None:
    """A script that never calls cleanup(): the sandbox is stopped at exit, which does not hang."""
    env = get_environment({"environment_class": "dsec.integrations.minisweagent.DsecEnvironment"})
    json.dump({"sandbox": env.sandbox.id, "ran": env.execute({"command": "echo hi"})}, sys.stdout)


if __name__ == "__main__":
    exit_without_cleanup() if sys.argv[1:] == ["--exit-without-cleanup"] else main()
