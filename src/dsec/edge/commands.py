"""Turning an exec request into the argv and environment the agent runs.

Commands run in dsec's own shell, ``/.dsec/bin/sh`` (read-only in every sandbox, see
agent/tools.py), never the image's ``/bin/sh``, which the sandbox may have replaced: what a
command string exits with is what the result says. Programs the command itself names are the
image's (docs/SECURITY.md).

Named shell sessions are a thin layer over plain execs: each session command runs in dsec's
shell, which first restores the session's state (its exported environment and cwd) and,
on exit, saves it again as a sourceable script. The agent stays stateless; a session
survives any single command, including one that calls ``exit``.
"""

from __future__ import annotations

import posixpath
import re
import shlex

from ..agent.tools import BUSYBOX, RUN_DIR, SHELL
from ..protocol.errors import InvalidRequest
from ..protocol.models import ExecRequest

DEFAULT_CWD = "/work"
SESSION_DIR = RUN_DIR
_SESSION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_SESSION_SCRIPT = """\
__dsec_state={state}
[ -f "$__dsec_state" ] && . "$__dsec_state" && cd "$__DSEC_PWD" 2>/dev/null
{setup}trap '__dsec_rc=$?; __DSEC_PWD=$PWD; export __DSEC_PWD; \
export -p > "$__dsec_state.tmp" && {busybox} mv -f "$__dsec_state.tmp" "$__dsec_state"; exit $__dsec_rc' 0
__dsec_cmd=$1; shift; eval "$__dsec_cmd"
"""


def sandbox_path(path: str) -> str:
    """A client path as an absolute, normalised path inside the sandbox. Relative paths are
    taken from /work; ``..`` components are refused rather than resolved, so a path can never
    name something its text does not show."""
    if not path or "\x00" in path:
        raise InvalidRequest("a path must be a non-empty string without NUL bytes", path=path)
    if ".." in path.split("/"):
        raise InvalidRequest("'..' is not allowed in sandbox paths", path=path)
    full = path if path.startswith("/") else posixpath.join(DEFAULT_CWD, path)
    return posixpath.normpath(full).replace("//", "/")


def check_env(env: dict[str, str]) -> dict[str, str]:
    for name, value in env.items():
        if not _ENV_NAME.match(name) or "\x00" in value:
            raise InvalidRequest(f"invalid environment variable {name!r}")
    return env


def as_user(user: str, argv: list[str]) -> list[str]:
    """``argv`` run as the image's ``user`` (a Dockerfile's USER: a name in the image's
    /etc/passwd, or ``root``/``0``: unchanged), through dsec's busybox ``su``, which the
    agent's commands may run (they keep CAP_SETUID and CAP_SETGID); ``-p`` keeps the env."""
    name = user.partition(":")[0]
    if name in ("", "root", "0"):
        return argv
    return [BUSYBOX, "su", "-p", "-s", SHELL, name, "-c", 'exec "$0" "$@"', *argv]


def exec_argv(req: ExecRequest, default_cwd: str = DEFAULT_CWD) -> tuple[list[str], str]:
    """(argv, cwd) for a request, wrapping session commands. In a session, the call's env is
    exported into the session and an explicit cwd replaces the session's. Without a cwd the
    command runs in ``default_cwd`` (the image's working directory)."""
    check_env(req.env)
    cwd = sandbox_path(req.cwd) if req.cwd else default_cwd
    if req.session is None:
        argv = [SHELL, "-c", req.command] if isinstance(req.command, str) else list(req.command)
        if not argv:
            raise InvalidRequest("command must not be empty")
        return argv, cwd
    if not _SESSION_NAME.match(req.session):
        raise InvalidRequest("a session name is 1-64 of [A-Za-z0-9_.-]", session=req.session)
    command = req.command if isinstance(req.command, str) else shlex.join(req.command)
    setup = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in req.env.items())
    if req.cwd:
        setup += f"cd {shlex.quote(cwd)} || exit 1\n"
    script = _SESSION_SCRIPT.format(state=shlex.quote(f"{SESSION_DIR}/session-{req.session}.sh"),
                                    setup=setup, busybox=BUSYBOX)
    return [SHELL, "-c", script, "dsec-session", command], cwd
