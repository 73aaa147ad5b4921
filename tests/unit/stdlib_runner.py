"""Run the unit tests that need only the standard library (the archive extractor) on any
Python 3.10+ without pytest or dsec's dependencies, e.g. the oldest and newest supported
interpreters::

    ~/.pyenv/versions/3.10.13/bin/python tests/unit/stdlib_runner.py

``dsec`` and ``dsec.protocol`` are registered as bare packages over ``src/`` so that importing
``dsec.protocol.archive`` loads only that module and ``dsec.protocol.errors`` (no SDK, no
pydantic). Each ``test_*`` function gets a fresh temporary directory as its ``tmp_path``.
"""

from __future__ import annotations

import importlib
import sys
import tempfile
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / "src"
MODULES = ["test_archive"]


def bare_package(name: str, path: Path) -> None:
    package = types.ModuleType(name)
    package.__path__ = [str(path)]
    sys.modules[name] = package


def main() -> int:
    bare_package("dsec", SRC / "dsec")
    bare_package("dsec.protocol", SRC / "dsec" / "protocol")
    sys.path.insert(0, str(HERE))
    failed = passed = 0
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(n for n in vars(module) if n.startswith("test_")):
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    getattr(module, name)(Path(tmp))
                except Exception:  # noqa: BLE001 (a runner reports every failure)
                    failed += 1
                    print(f"FAIL {module_name}.{name}\n{traceback.format_exc()}")
                else:
                    passed += 1
                    print(f"ok   {module_name}.{name}")
    print(f"Python {sys.version.split()[0]}: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
