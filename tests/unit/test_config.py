"""The one configuration module: precedence, the ``serve`` options made from it, the README
table, and no environment read anywhere else in the server."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from dsec.cli import serve
from dsec.config import CLIENT_ENV, Settings, env_name, readme_table

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "dsec"
# Who may still touch the environment, and why.
ENV_READERS = {
    "config.py": "the one place settings are read",
    "client/transport.py": "the SDK's own variables (config.CLIENT_ENV)",
    "cluster/local.py": "Ray's own variable for the test and benchmark cluster",
    "substrates/host/spawn.py": "hands the server's environment to the runtimes it runs",
    "images/builder.py": "hands the environment to mmdebstrap and apt",
    "integrations/minisweagent.py": "mini-swe-agent's forward_env: host variables a config names",
    "images/registry.py": "docker's own DOCKER_CONFIG, where DSEC_REGISTRY_AUTH is unset",
}


def test_options_over_environment_over_defaults() -> None:
    env = {"DSEC_CAPACITY": "9", "DSEC_WARM_POOL": "3", "DSEC_VM_SNAPSHOTS": "yes",
           "DSEC_FN_PRELOAD": "numpy,scipy", "DSEC_STATE_DIR": "/srv/dsec"}
    s = Settings.load(env, capacity=4, kvm_device=None)
    assert (s.capacity, s.warm_pool, s.vm_snapshots) == (4, 3, True)
    assert s.fn_preload == ("numpy", "scipy") and s.state_dir == Path("/srv/dsec")
    assert s.kvm_device == Path("/dev/kvm") and s.store_target == Path("/srv/dsec/state.db")
    assert Settings.load({}, capacity="12").capacity == 12  # options given as text are parsed
    with pytest.raises(ValueError, match="DSEC_PORT"):
        Settings.load({"DSEC_PORT": "eighty"})
    with pytest.raises(TypeError, match="no_such"):
        Settings.load({}, no_such=1)


def test_every_option_of_serve_is_a_setting() -> None:
    options = {p.name: p.opts[0] for p in serve.params}
    expected = {f.name: f.metadata["option"] for f in fields(Settings) if f.metadata["option"]}
    assert options == expected


def test_the_readme_lists_every_variable_and_option() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme_table() in readme, "paste config.readme_table() into the README"
    for f in fields(Settings):
        assert f"| `{env_name(f.name)}` |" in readme_table()
    for variable in CLIENT_ENV:
        assert f"| `{variable}` |" in readme


def test_no_environment_read_outside_the_config_module() -> None:
    readers = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
               if not path.name.startswith("bench")
               and re.search(r"\bos\.environ\b|\bgetenv\(|\benvvar=", path.read_text())}
    assert readers <= set(ENV_READERS), readers - set(ENV_READERS)
