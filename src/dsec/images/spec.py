"""Declarative image specs (TOML) and their validation.

A spec has three sections, each built as one layer on top of the previous one:
``[base]`` (mmdebstrap), ``[toolkit]`` (Debian and pip packages) and ``[workspace]``
(files and commands). Every mistake raises ``InvalidRequest`` naming the offending key.
"""

from __future__ import annotations

import posixpath
import re
import tomllib
from collections.abc import Collection
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

from dsec.protocol.errors import InvalidRequest

IMAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_SUITE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")
# Debian package name, optionally pinned to a version (``pkg=1.2-3``).
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+~:-]+)?$")
VARIANTS = ("essential", "apt", "required", "minbase", "buildd", "important", "standard")
WORKDIR = "/work"


@dataclass(frozen=True)
class BaseSection:
    suite: str = "bookworm"
    variant: str = "minbase"

    def to_dict(self) -> dict[str, Any]:
        return {"suite": self.suite, "variant": self.variant}


@dataclass(frozen=True)
class ToolkitSection:
    packages: tuple[str, ...] = ()
    pip: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.packages and not self.pip

    def to_dict(self) -> dict[str, Any]:
        return {"packages": list(self.packages), "pip": list(self.pip)}


@dataclass(frozen=True)
class WorkspaceSection:
    files: tuple[tuple[str, str], ...] = ()  # (absolute path, text content), in spec order
    commands: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"files": dict(self.files), "commands": list(self.commands)}


@dataclass(frozen=True)
class ImageSpec:
    name: str
    base: BaseSection = field(default_factory=BaseSection)
    toolkit: ToolkitSection = field(default_factory=ToolkitSection)
    workspace: WorkspaceSection = field(default_factory=WorkspaceSection)


def builtin_names() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in _builtin_dir().iterdir() if p.name.endswith(".toml"))


def load_spec(path_or_builtin_name: str | Path) -> ImageSpec:
    """Load a spec from a TOML file, or a shipped one by name (``python-3.11``)."""
    path = Path(path_or_builtin_name)
    if not path.is_file():
        if str(path_or_builtin_name) not in builtin_names():
            raise InvalidRequest(
                f"no spec file {str(path_or_builtin_name)!r} and no builtin spec of that name "
                f"(builtins: {', '.join(builtin_names())})"
            )
        path = _builtin_dir() / f"{path_or_builtin_name}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequest(f"spec {path}: invalid TOML: {exc}") from exc
    return parse_spec(data, source=str(path))


def parse_spec(data: dict[str, Any], source: str = "spec") -> ImageSpec:
    """Validate a decoded TOML document into an ``ImageSpec``."""
    v = _Validator(source)
    v.keys(data, "", required={"name", "base"}, optional={"toolkit", "workspace"})
    name = v.string(data["name"], "name")
    if not IMAGE_NAME.match(name):
        v.fail("name", f"{name!r} is not a valid image name (letters, digits, '.', '_', ':', '-')")
    return ImageSpec(
        name=name,
        base=_parse_base(v, v.table(data["base"], "base")),
        toolkit=_parse_toolkit(v, v.table(data.get("toolkit", {}), "toolkit")),
        workspace=_parse_workspace(v, v.table(data.get("workspace", {}), "workspace")),
    )


def _parse_base(v: _Validator, table: dict[str, Any]) -> BaseSection:
    v.keys(table, "base", required={"suite"}, optional={"variant"})
    suite = v.string(table["suite"], "base.suite")
    if not _SUITE.match(suite):
        v.fail("base.suite", f"{suite!r} is not a Debian suite name")
    variant = v.string(table.get("variant", "minbase"), "base.variant")
    if variant not in VARIANTS:
        v.fail("base.variant", f"{variant!r} is not one of {', '.join(VARIANTS)}")
    return BaseSection(suite=suite, variant=variant)


def _parse_toolkit(v: _Validator, table: dict[str, Any]) -> ToolkitSection:
    v.keys(table, "toolkit", optional={"packages", "pip"})
    packages = v.strings(table.get("packages", []), "toolkit.packages")
    for package in packages:
        if not _PACKAGE.match(package):
            v.fail("toolkit.packages", f"{package!r} is not a Debian package name")
    pip = v.strings(table.get("pip", []), "toolkit.pip")
    for requirement in pip:
        if requirement.startswith("-") or not requirement.strip():
            v.fail("toolkit.pip", f"{requirement!r} is not a requirement (options are not allowed)")
    if pip and "python3-pip" not in {p.split("=")[0] for p in packages}:
        v.fail("toolkit.pip", "needs pip in the image: add 'python3-pip' to toolkit.packages")
    return ToolkitSection(packages=packages, pip=pip)


def _parse_workspace(v: _Validator, table: dict[str, Any]) -> WorkspaceSection:
    v.keys(table, "workspace", optional={"files", "commands"})
    files = v.table(table.get("files", {}), "workspace.files")
    for path, content in files.items():
        key = f"workspace.files.{path!r}"
        if not path.startswith("/") or posixpath.normpath(path) != path or path == "/":
            v.fail(key, "must be a normalised absolute file path such as '/work/README.txt'")
        v.string(content, key)
    commands = v.strings(table.get("commands", []), "workspace.commands")
    if any(not c.strip() for c in commands):
        v.fail("workspace.commands", "commands must not be empty")
    return WorkspaceSection(files=tuple(files.items()), commands=commands)


class _Validator:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, problem: str) -> NoReturn:
        raise InvalidRequest(f"{self.source}: {key}: {problem}", key=key)

    def keys(
        self,
        table: dict[str, Any],
        where: str,
        required: Collection[str] = (),
        optional: Collection[str] = (),
    ) -> None:
        allowed = {*required, *optional}
        for key in table:
            if key not in allowed:
                self.fail(
                    f"{where}.{key}" if where else key,
                    f"unknown key (expected one of: {', '.join(sorted(allowed))})",
                )
        for key in sorted(set(required) - table.keys()):
            self.fail(f"{where}.{key}" if where else key, "missing required key")

    def table(self, value: Any, key: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(key, f"must be a table, got {_type(value)}")
        return value

    def string(self, value: Any, key: str) -> str:
        if not isinstance(value, str):
            self.fail(key, f"must be a string, got {_type(value)}")
        return value

    def strings(self, value: Any, key: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            self.fail(key, f"must be a list of strings, got {_type(value)}")
        for index, item in enumerate(value):
            if not isinstance(item, str):
                self.fail(key, f"must be a list of strings, item {index} is {_type(item)}")
        return tuple(value)


def _type(value: Any) -> str:
    toml_names: dict[type, str] = {dict: "table", list: "array", str: "string"}
    return toml_names.get(type(value), type(value).__name__)


def _builtin_dir() -> Path:
    return Path(str(resources.files("dsec.images") / "specs"))
