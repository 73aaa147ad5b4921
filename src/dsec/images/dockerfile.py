"""Dockerfile parsing: the text of a Dockerfile as a list of typed instructions.

Only parsing lives here (no sandbox, no store), so that the build driver (edge/dockerbuild.py,
which runs RUN steps in real sandboxes) and its tests share one reading of the format:
line continuations (``\\`` or the ``# escape=`` character), comments, JSON (exec) and shell
forms, and ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` / ``${VAR:+alt}`` substitution from ARG
and ENV in the instructions Docker substitutes in (not in RUN, CMD, ENTRYPOINT, whose shell
does its own). Anything outside the supported subset is a typed ``InvalidRequest`` naming the
line, never silently ignored.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

from dsec.protocol.errors import InvalidRequest, NotSupported

SUPPORTED = ("FROM", "RUN", "COPY", "ADD", "ENV", "WORKDIR", "USER", "ARG", "LABEL",
             "ENTRYPOINT", "CMD")
# Accepted and kept out of the image (no effect on a dsec sandbox): documentation only.
IGNORED = ("EXPOSE", "VOLUME", "STOPSIGNAL", "HEALTHCHECK", "MAINTAINER")
# Would change what later steps (or child images) do: refused rather than ignored.
REFUSED = ("SHELL", "ONBUILD")
SUBSTITUTED = ("FROM", "COPY", "ADD", "ENV", "WORKDIR", "USER", "LABEL", "ARG")
RUN_NETWORKS = ("none", "default")  # RUN --network=: offline, or the build's egress
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?:(:[-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?")
_ESCAPE_DIRECTIVE = re.compile(r"^#\s*escape\s*=\s*([\\`])\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Instruction:
    """One instruction: ``args`` is the argument text after substitution (for RUN, CMD and
    ENTRYPOINT: as written); ``argv`` is set for the JSON (exec) form; ``line`` is where it
    starts (1-based), for error messages; ``flags`` holds ``--from=`` style options."""

    keyword: str
    args: str
    line: int
    argv: tuple[str, ...] | None = None
    flags: dict[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The instruction as the build cache keys it: keyword, flags and arguments, the
        arguments exactly as they run (``printf 'a  b'`` is not ``printf 'a b'``: one
        project's layer must never answer another's different command)."""
        flags = " ".join(f"--{k}={v}" for k, v in sorted(self.flags.items()))
        body = json.dumps(list(self.argv)) if self.argv is not None else self.args
        return " ".join(part for part in (self.keyword, flags, body) if part)


def substitute(text: str, values: dict[str, str]) -> str:
    """``$VAR``, ``${VAR}``, ``${VAR:-default}`` and ``${VAR:+alt}`` from ``values``; an
    unset variable is empty, as in Docker. ``\\$`` keeps a literal dollar."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("\\$", i):
            out.append("$")
            i += 2
            continue
        match = _VAR.match(text, i) if text[i] == "$" else None
        if match is None:
            out.append(text[i])
            i += 1
            continue
        name = match.group(1) or match.group(4)
        value = values.get(name)
        if match.group(2) == ":-":
            value = value if value else match.group(3)
        elif match.group(2) == ":+":
            value = match.group(3) if value else ""
        out.append(value or "")
        i = match.end()
    return "".join(out)


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, joined text) per instruction: comments and blank lines dropped,
    continuation lines joined (comment lines inside a continuation are skipped, as Docker
    does)."""
    lines = text.splitlines()
    escape = "\\"
    if lines and (m := _ESCAPE_DIRECTIVE.match(lines[0].strip())):
        escape = m.group(1)
    result: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    for number, raw in enumerate(lines, 1):
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        if not current:
            start = number
        if raw.rstrip().endswith(escape):
            current.append(raw.rstrip()[:-1])
            continue
        current.append(raw)
        result.append((start, " ".join(part.strip() for part in current).strip()))
        current = []
    if current:
        result.append((start, " ".join(part.strip() for part in current).strip()))
    return result


def parse(text: str, build_args: dict[str, str] | None = None,
          base_env: dict[str, str] | None = None) -> list[Instruction]:
    """The instructions of a Dockerfile, with ARG and ENV substituted where Docker does.
    ``build_args`` (``--build-arg``) override ARG defaults; only declared ARGs are used.
    ``base_env``: the FROM image's environment, which instructions after FROM see
    (``ENV PATH=/opt/venv/bin:$PATH``)."""
    given = dict(build_args or {})
    values: dict[str, str] = {}
    instructions: list[Instruction] = []
    saw_from = False
    for line, content in logical_lines(text):
        keyword, _, rest = content.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword in IGNORED:
            continue
        if keyword in REFUSED:
            raise NotSupported(f"Dockerfile line {line}: {keyword} is not supported", line=line)
        if keyword not in SUPPORTED:
            raise InvalidRequest(f"Dockerfile line {line}: unknown instruction {keyword!r}",
                                 line=line)
        if not saw_from and keyword not in ("FROM", "ARG"):
            raise InvalidRequest(f"Dockerfile line {line}: {keyword} before FROM", line=line)
        flags, rest = _flags(rest, line)
        argv = _json_form(rest) if keyword in ("RUN", "CMD", "ENTRYPOINT", "COPY", "ADD") else None
        if keyword in SUBSTITUTED:
            rest = substitute(rest, values)
            if argv is not None:
                argv = tuple(substitute(a, values) for a in argv)
            flags = {k: substitute(v, values) for k, v in flags.items()}
        if not rest and keyword not in ("CMD", "ENTRYPOINT"):
            raise InvalidRequest(f"Dockerfile line {line}: {keyword} needs arguments", line=line)
        if keyword == "FROM":
            if saw_from:
                raise NotSupported(f"Dockerfile line {line}: multi-stage builds (a second FROM) "
                                   "are not supported", line=line)
            if " " in rest:
                raise NotSupported(f"Dockerfile line {line}: FROM ... AS (stages) is not "
                                   "supported", line=line)
            saw_from = True
            values.update(base_env or {})
        elif keyword == "ARG":
            for name, default in _pairs(rest, line, arg=True):
                values[name] = given.get(name, values.get(name, default or ""))
        elif keyword == "ENV":
            values.update((k, v or "") for k, v in _pairs(rest, line))
        elif keyword == "USER" and not _USER.fullmatch(rest):
            raise InvalidRequest(f"Dockerfile line {line}: USER {rest!r} is not a user name or "
                                 "uid (with an optional :group)", line=line)
        elif keyword in ("COPY", "ADD") and set(flags) - {"chown", "chmod"}:
            raise NotSupported(f"Dockerfile line {line}: {keyword} {sorted(flags)} is not "
                               "supported (only --chown and --chmod)", line=line)
        elif keyword == "RUN" and (set(flags) - {"network"}
                                   or flags.get("network", "none") not in RUN_NETWORKS):
            # a flag dropped without a word would run the step otherwise than asked (a
            # --network=none step with the build's egress, a secret mount's step without it)
            asked = " ".join(f"--{k}={v}" for k, v in flags.items())
            raise NotSupported(f"Dockerfile line {line}: RUN {asked} is not supported (only "
                               "--network=none or --network=default)", line=line)
        instructions.append(Instruction(keyword, rest, line, argv, flags))
    if not saw_from:
        raise InvalidRequest("the Dockerfile has no FROM instruction")
    return instructions


def base_image(text: str, build_args: dict[str, str] | None = None) -> str:
    """The image the Dockerfile's FROM names; the whole file is parsed, so a bad one is
    ``InvalidRequest`` (``NotSupported``) here, before a build starts."""
    for instruction in parse(text, build_args):
        if instruction.keyword == "FROM":
            return instruction.args
    raise InvalidRequest("the Dockerfile has no FROM")


def pairs(instruction: Instruction) -> list[tuple[str, str]]:
    """ENV / LABEL / ARG arguments as (name, value) pairs, quotes removed."""
    return [(k, v or "") for k, v in _pairs(instruction.args, instruction.line,
                                             arg=instruction.keyword == "ARG")]


def sources_and_dest(instruction: Instruction) -> tuple[list[str], str]:
    """COPY / ADD: the source paths (in the context) and the destination."""
    parts = list(instruction.argv) if instruction.argv is not None else _split(
        instruction.args, instruction.line)
    if len(parts) < 2:
        raise InvalidRequest(f"Dockerfile line {instruction.line}: {instruction.keyword} needs "
                             "a source and a destination", line=instruction.line)
    return parts[:-1], parts[-1]


def _flags(rest: str, line: int) -> tuple[dict[str, str], str]:
    flags: dict[str, str] = {}
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        name, eq, value = word[2:].partition("=")
        if not eq:
            raise InvalidRequest(f"Dockerfile line {line}: flag {word!r} needs a value", line=line)
        flags[name] = value
        rest = rest.strip()
    return flags, rest


def _json_form(rest: str) -> tuple[str, ...] | None:
    """The exec form (a JSON array of strings), or None for the shell form."""
    if not rest.startswith("["):
        return None
    try:
        value = json.loads(rest)
    except ValueError:
        return None  # Docker treats a malformed array as the shell form
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def _split(text: str, line: int) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise InvalidRequest(f"Dockerfile line {line}: {exc}", line=line) from None


def _pairs(text: str, line: int, arg: bool = False) -> list[tuple[str, str | None]]:
    """``a=1 b="two words"``, or the legacy ``NAME value with spaces`` (ENV and LABEL)."""
    words = _split(text, line)
    if not arg and words and "=" not in words[0]:
        if len(words) < 2:
            raise InvalidRequest(f"Dockerfile line {line}: {text!r} needs a value", line=line)
        return [(words[0], text.split(None, 1)[1].strip().strip('"'))]
    result: list[tuple[str, str | None]] = []
    for word in words:
        name, eq, value = word.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
            raise InvalidRequest(f"Dockerfile line {line}: {name!r} is not a valid name",
                                 line=line)
        result.append((name, value if eq else None))
    return result
