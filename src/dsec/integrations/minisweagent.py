"""A mini-swe-agent 2.x environment whose commands run in a dsec sandbox.

mini-swe-agent loads environments by import path, so a YAML config needs only
``environment_class: dsec.integrations.minisweagent.DsecEnvironment`` plus the sandbox's image
and limits; the server and key come from ``DSEC_URL`` and ``DSEC_API_KEY`` as for any SDK use.
The class follows mini-swe-agent's own environments (docker, local): ``execute`` returns
``{"output", "returncode", "exception_info"}`` with stdout and stderr merged in order, a
command past its timeout comes back as an observation (returncode -1, its partial output) for
the agent to read, and the agent's submit marker (``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` as
the first line of a successful command) raises mini-swe-agent's ``Submitted``. Anything else
dsec raises (the sandbox died, the server refused) ends the agent's run with that typed error
instead of being shown to the model as command output.

The sandbox's output is the agent's, so hostile: it is capped by the server
(``max_output_bytes``) and decoded with replacement, never interpreted here beyond the
marker. Needs ``pip install mini-swe-agent`` beside dsec (tested with 2.4.6).
"""

from __future__ import annotations

import os
import shlex
import weakref
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from ..client.aio import CommandResult
from ..client.sync import Client, Sandbox
from ..protocol.errors import CommandTimeout, SandboxNotFound

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
UNAME_FIELDS = ("system", "node", "release", "version", "machine")  # platform.uname()'s names


class DsecEnvironmentConfig(BaseModel):
    image: str = "debian-minbase"
    """dsec image the sandbox starts from (``dsec images``)."""
    substrate: str = "container"
    """``container``, ``microvm`` or ``vm``."""
    cwd: str = ""
    """Working directory of every command; empty: the sandbox's default."""
    env: dict[str, str] = {}
    """Environment variables of every command."""
    forward_env: list[str] = []
    """Host environment variables passed to every command when set (``env`` wins)."""
    timeout: int = 30
    """Seconds a command may run before its process group is killed."""
    interpreter: list[str] = ["bash", "-lc"]
    """The command is appended to this argv, as in mini-swe-agent's docker environment."""
    cpu: float | None = None
    memory_mb: int | None = None
    pids: int | None = None
    disk_mb: int | None = None
    ttl_s: int | None = None
    """Sandbox lifetime; None: the server's default (600 s)."""
    network: Any = None
    """``"none"`` (the server's default) or a dsec network policy, e.g. ``{"pypi": true}``."""
    max_output_bytes: int | None = None
    """Cap on a command's output; None: the server's default."""


class DsecEnvironment:
    """mini-swe-agent's ``Environment`` over one dsec sandbox, created at construction and
    stopped by ``cleanup()``, when the object is collected, or at exit."""

    def __init__(self, *, config_class: type[DsecEnvironmentConfig] = DsecEnvironmentConfig,
                 **kwargs: Any) -> None:
        self.config = c = config_class(**kwargs)
        client = Client()
        try:
            self._sandbox: Sandbox | None = client.create(
                c.substrate, c.image, cpu=c.cpu, memory_mb=c.memory_mb, pids=c.pids,
                disk_mb=c.disk_mb, ttl_s=c.ttl_s, network=c.network,
                labels={"harness": "mini-swe-agent"})
        except BaseException:
            client.close()
            raise
        # stopped by cleanup(), when the environment is collected, or at exit (atexit runs
        # before the interpreter freezes the client's loop thread; __del__ at shutdown would
        # wait on it forever)
        self._stop = weakref.finalize(self, _stop, client, self._sandbox)
        self._uname = self._read_uname()

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            raise RuntimeError("the dsec sandbox was stopped by cleanup()")
        return self._sandbox

    def _read_uname(self) -> dict[str, str]:
        """The sandbox's uname, for templates that name the system (as docker's does the
        host's); the sandbox's answer is plain text, used only if it has all five lines."""
        result = self.sandbox.run("; ".join(f"uname -{flag}" for flag in "snrvm"), timeout_s=30)
        lines = result.stdout.splitlines()
        return dict(zip(UNAME_FIELDS, lines)) if result.ok and len(lines) == 5 else {}

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` under the interpreter; the result dict mini-swe-agent's
        observation templates read. Raises ``Submitted`` when the agent submits."""
        timeout_s = timeout or self.config.timeout
        # dsec's own shell merges the interpreter's stderr into stdout, in order, as docker's
        # environment does with stderr=STDOUT
        command = shlex.join([*self.config.interpreter, action.get("command", "")]) + " 2>&1"
        try:
            result = self.sandbox.run(command, env=self._env(), cwd=cwd or self.config.cwd or None,
                                      timeout_s=timeout_s,
                                      max_output_bytes=self.config.max_output_bytes)
            output = {"output": _text(result), "returncode": result.exit_code,
                      "exception_info": ""}
        except CommandTimeout as exc:
            partial: CommandResult | None = getattr(exc, "result", None)
            output = {"output": "" if partial is None else _text(partial), "returncode": -1,
                      "exception_info": f"An error occurred while executing the command: {exc}",
                      "extra": {"exception_type": type(exc).__name__, "exception": str(exc)}}
        _raise_if_submitted(output)
        return output

    def _env(self) -> dict[str, str]:
        forwarded = {k: os.environ[k] for k in self.config.forward_env if k in os.environ}
        return {**forwarded, **self.config.env}

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        sandbox = {} if self._sandbox is None else {"sandbox_id": self._sandbox.id}
        return recursive_merge(self.config.model_dump(), self._uname, sandbox, kwargs)

    def serialize(self) -> dict:
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json"),
            "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}

    def cleanup(self) -> None:
        """Stop the sandbox and close the client; safe to call twice."""
        self._sandbox = None
        self._stop()


def _stop(client: Client, sandbox: Sandbox) -> None:
    try:
        sandbox.stop()
    except SandboxNotFound:
        pass  # already gone: its TTL ran out
    finally:
        client.close()


def _text(result: CommandResult) -> str:
    """The merged output; a cut at the server's cap says so, as the agent should know."""
    text = result.stdout
    if result.stdout_truncated:
        text += f"\n[dsec: output truncated at {len(result.stdout_bytes)} bytes]\n"
    return text


def _raise_if_submitted(output: dict[str, Any]) -> None:
    """mini-swe-agent's end of a task: a successful command whose first non-blank line is the
    marker; everything after that line is the submission."""
    if output["returncode"] != 0:
        return
    lines = output["output"].lstrip().splitlines(keepends=True)
    if lines and lines[0].strip() == SUBMIT_MARKER:
        rest = "".join(lines[1:])
        raise Submitted({"role": "exit", "content": rest,
                         "extra": {"exit_status": "Submitted", "submission": rest}})
