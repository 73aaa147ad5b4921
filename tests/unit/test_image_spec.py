"""Image specs (TOML): the shipped ones and well-formed ones load into what they say; every
mistake is an ``InvalidRequest`` naming the offending key (``details["key"]``)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from dsec.images.spec import (
    BaseSection,
    ImageSpec,
    ToolkitSection,
    WorkspaceSection,
    builtin_names,
    load_spec,
    parse_spec,
)
from dsec.protocol.errors import InvalidRequest

FULL = """
name = "my_image:1.0-rc.2"

[base]
suite = "trixie"
variant = "apt"

[toolkit]
packages = ["python3-pip", "git=1:2.39.2-1", "g++"]
pip = ["requests==2.31.0", "numpy>=1.26"]

[workspace]
commands = ["echo ready > /work/ready", "true"]

[workspace.files]
"/work/README.txt" = "hello\\n"
"/etc/app/config.ini" = "[app]\\nkey = 1\\n"
"""


def test_a_full_spec_loads_into_what_it_says(tmp_path: Path) -> None:
    path = tmp_path / "spec.toml"
    path.write_text(FULL)
    assert load_spec(path) == ImageSpec(
        name="my_image:1.0-rc.2",
        base=BaseSection(suite="trixie", variant="apt"),
        toolkit=ToolkitSection(packages=("python3-pip", "git=1:2.39.2-1", "g++"),
                               pip=("requests==2.31.0", "numpy>=1.26")),
        workspace=WorkspaceSection(files=(("/work/README.txt", "hello\n"),
                                          ("/etc/app/config.ini", "[app]\nkey = 1\n")),
                                   commands=("echo ready > /work/ready", "true")))


def test_a_minimal_spec_takes_the_defaults() -> None:
    spec = parse_spec({"name": "tiny", "base": {"suite": "bookworm"}})
    assert spec == ImageSpec(name="tiny")
    assert spec.base.to_dict() == {"suite": "bookworm", "variant": "minbase"}
    assert spec.toolkit.empty and spec.toolkit.to_dict() == {"packages": [], "pip": []}
    assert spec.workspace.to_dict() == {"files": {}, "commands": []}


def test_the_shipped_specs_load() -> None:
    names = builtin_names()
    assert {"debian-minbase", "python-3.11"} <= set(names)
    for name in names:
        assert load_spec(name).name == name
    python = load_spec("python-3.11")
    assert python.base == BaseSection("bookworm", "minbase")
    assert "python3" in python.toolkit.packages


DELETE = object()  # a spec_with() value: remove the key


def spec_with(**changes: Any) -> dict[str, Any]:
    """FULL with ``table__key=value`` changes."""
    data = tomllib.loads(FULL)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        table = data
        for parent in parents:
            table = table[parent]
        if value is DELETE:
            del table[last]
        else:
            table[last] = value
    return data



@pytest.mark.parametrize(("changes", "key"), [
    ({"name": DELETE}, "name"),
    ({"base": DELETE}, "base"),
    ({"extra": 1}, "extra"),
    ({"name": 5}, "name"),
    ({"name": "-leading-dash"}, "name"),
    ({"name": "has space"}, "name"),
    ({"name": "x" * 129}, "name"),
    ({"name": ""}, "name"),
    ({"base": "bookworm"}, "base"),
    ({"base__mirror": "http://deb"}, "base.mirror"),
    ({"base__suite": DELETE}, "base.suite"),
    ({"base__suite": "Bookworm"}, "base.suite"),
    ({"base__suite": "../x"}, "base.suite"),
    ({"base__variant": "tiny"}, "base.variant"),
    ({"base__variant": 1}, "base.variant"),
    ({"toolkit": []}, "toolkit"),
    ({"toolkit__apt": []}, "toolkit.apt"),
    ({"toolkit__packages": "git"}, "toolkit.packages"),
    ({"toolkit__packages": ["python3-pip", 3]}, "toolkit.packages"),
    ({"toolkit__packages": ["python3-pip", "Git"]}, "toolkit.packages"),
    ({"toolkit__packages": ["python3-pip", "g"]}, "toolkit.packages"),
    ({"toolkit__packages": ["python3-pip", "git; rm -rf /"]}, "toolkit.packages"),
    ({"toolkit__packages": ["python3-pip", "--allow-unauthenticated"]}, "toolkit.packages"),
    ({"toolkit__pip": ["-e ."]}, "toolkit.pip"),
    ({"toolkit__pip": ["--index-url=http://evil"]}, "toolkit.pip"),
    ({"toolkit__pip": ["  "]}, "toolkit.pip"),
    ({"toolkit__packages": ["git"]}, "toolkit.pip"),  # pip wanted, pip not installed
    ({"workspace__files": {"work/relative": "x"}}, "workspace.files.'work/relative'"),
    ({"workspace__files": {"/work/../etc/passwd": "x"}}, "workspace.files.'/work/../etc/passwd'"),
    ({"workspace__files": {"/work/dir/": "x"}}, "workspace.files.'/work/dir/'"),
    ({"workspace__files": {"/": "x"}}, "workspace.files.'/'"),
    ({"workspace__files": {"/work/n": 5}}, "workspace.files.'/work/n'"),
    ({"workspace__files": ["/work/a"]}, "workspace.files"),
    ({"workspace__commands": ["ok", " "]}, "workspace.commands"),
    ({"workspace__commands": "echo"}, "workspace.commands"),
    ({"workspace__run": []}, "workspace.run"),
])
def test_every_mistake_names_its_key(changes: dict[str, Any], key: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        parse_spec(spec_with(**changes), source="bad.toml")
    assert raised.value.details == {"key": key}
    assert raised.value.message.startswith(f"bad.toml: {key}: ")
    assert raised.value.status == 400


def test_a_pinned_pip_package_is_pip() -> None:
    spec = parse_spec(spec_with(toolkit__packages=["python3-pip=23.0.1+dfsg-1"]))
    assert spec.toolkit.pip == ("requests==2.31.0", "numpy>=1.26")


def test_an_unknown_name_lists_the_builtins() -> None:
    with pytest.raises(InvalidRequest, match="python-3.11"):
        load_spec("no-such-spec")


def test_a_file_that_is_not_toml(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text('name = "x"\n[base\n')
    with pytest.raises(InvalidRequest, match="invalid TOML"):
        load_spec(path)
