"""Egress policies before any packet: the grammar of one rule, the named service table (shipped
defaults, the operator's file over them, edits picked up live) and the resolution of a policy
to the rules the host enforces. Host names resolve through /etc/hosts (``localhost``), so no
DNS is needed except for the one name that must not resolve."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pydantic
import pytest

from dsec.network.policy import Egress, Rule, ServiceTable, resolve
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import CreateRequest, NetworkPolicy
from dsec.protocol.rules import Destination, parse_rule


@pytest.mark.parametrize(("text", "host", "port"), [
    ("10.1.2.3:443", "10.1.2.3", 443),
    ("10.1.2.3", "10.1.2.3", None),
    ("192.168.0.0/24", "192.168.0.0/24", None),
    ("0.0.0.0/0", "0.0.0.0/0", None),
    ("pypi.org:443", "pypi.org", 443),
    ("Files.PythonHosted.ORG.:1", "files.pythonhosted.org", 1),  # case and a final dot do not matter
    ("localhost:65535", "localhost", 65535),
    ("a-b.c-d.example", "a-b.c-d.example", None),
])
def test_good_rules(text: str, host: str, port: int | None) -> None:
    assert parse_rule(text) == Destination(host, port)


def test_a_rule_is_a_network_or_a_name() -> None:
    assert parse_rule("10.1.2.3").network == ipaddress.IPv4Network("10.1.2.3/32")
    assert parse_rule("10.9.0.0/16").network == ipaddress.IPv4Network("10.9.0.0/16")
    assert parse_rule("example.com:80").network is None


@pytest.mark.parametrize("text", [
    "", "x" * 301, "host:0", "host:65536", "host:", "host:http", "host:+80", "host:-1",
    "10.0.0.1/24",  # host bits set
    "10.0.0.0/33", "10.0.0.0/24:80",  # a CIDR takes no port
    "::1", "[::1]:443", "2001:db8::/32", "fe80::1",  # IPv6
    "-leading.example", "trailing-.example", "a..b", "under_score.example", "1.2.3", "300.1.2.3",
    "x" * 64 + ".example", "space in.name", "http://example.com",
])
def test_bad_rules_say_what_is_wrong(text: str) -> None:
    with pytest.raises(ValueError, match=r"\S"):
        parse_rule(text)


def test_a_rule_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_rule(443)  # type: ignore[arg-type]  # what a JSON client may send


def test_the_sdk_model_checks_every_rule_and_takes_the_shorthands() -> None:
    assert NetworkPolicy.model_validate(["10.0.0.1:80"]) == NetworkPolicy(allow=["10.0.0.1:80"])
    assert NetworkPolicy.model_validate({"pypi": True, "npm": False, "allow": ["10.0.0.1"]}) == \
        NetworkPolicy(services={"pypi": True, "npm": False}, allow=["10.0.0.1"])
    with pytest.raises(pydantic.ValidationError, match="10.0.0.1/8"):
        NetworkPolicy(allow=["10.0.0.1/8"])
    with pytest.raises(pydantic.ValidationError):
        NetworkPolicy.model_validate({"pypi": "yes"})  # booleans only
    with pytest.raises(pydantic.ValidationError):
        NetworkPolicy(allow=["10.0.0.1"] * 257)
    assert CreateRequest(network={"allow": ["10.0.0.1"]}).network == NetworkPolicy(allow=["10.0.0.1"])
    assert CreateRequest().network == "none"


def test_the_shipped_service_table() -> None:
    table = ServiceTable()
    assert {"pypi", "npm", "github", "huggingface", "debian"} <= set(table.services)
    assert table.destinations("pypi") == (Destination("pypi.org", 443), Destination("files.pythonhosted.org", 443))
    with pytest.raises(InvalidRequest) as raised:
        table.destinations("nope")
    assert raised.value.details["service"] == "nope" and "pypi" in raised.value.details["known"]


def write(path: Path, text: str, stamp: float) -> None:
    path.write_text(text)
    os.utime(path, (stamp, stamp))  # a distinct mtime, however fast the edits come


def test_the_operators_file_replaces_and_extends_the_defaults_live(tmp_path: Path) -> None:
    path = tmp_path / "services.toml"
    table = ServiceTable(path)  # no file yet: the defaults
    assert table.destinations("pypi")[0] == Destination("pypi.org", 443)
    write(path, '[services.pypi]\nallow = ["10.7.0.1:443"]\n[services.db]\nallow = ["10.8.0.0/16"]\n', 1000)
    assert table.destinations("pypi") == (Destination("10.7.0.1", 443),)
    assert table.destinations("db") == (Destination("10.8.0.0/16"),)
    assert table.destinations("npm") == (Destination("registry.npmjs.org", 443),)
    # a broken edit keeps the table in force
    write(path, '[services.db]\nallow = ["10.8.0.0/8"]\n', 2000)
    assert table.destinations("db") == (Destination("10.8.0.0/16"),)
    write(path, '[services.db]\nallow = ["10.6.0.1"]\n', 3000)
    assert table.destinations("db") == (Destination("10.6.0.1"),)
    assert table.destinations("pypi")[0] == Destination("pypi.org", 443)  # the default again


@pytest.mark.parametrize("text", [
    "[services.x]\nallow = ['::1']\n",  # a bad rule
    "[services.x]\ndescription = 'no allow'\n",
    "[services.x]\nallow = 5\n",
    "not toml at all [",
])
def test_a_broken_file_at_start_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "services.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match="bad network service table"):
        ServiceTable(path)


async def test_none_is_no_egress() -> None:
    assert await resolve("none", ServiceTable()) is None


async def test_a_policy_resolves_to_sorted_unique_rules_and_pinned_hosts(tmp_path: Path) -> None:
    path = tmp_path / "services.toml"
    write(path, '[services.internal]\nallow = ["10.9.0.0/16", "10.1.2.3:443"]\n', 1000)
    policy = NetworkPolicy(services={"internal": True, "pypi": False},
                           allow=["localhost:8080", "10.1.2.3:443", "10.0.0.0/24", "10.1.2.3"])
    egress = await resolve(policy, ServiceTable(path))
    net = ipaddress.IPv4Network
    assert egress == Egress(
        rules=(Rule(net("10.0.0.0/24")), Rule(net("10.1.2.3/32")), Rule(net("10.1.2.3/32"), 443),
               Rule(net("10.9.0.0/16")), Rule(net("127.0.0.1/32"), 8080)),
        hosts=(("localhost", "127.0.0.1"),))


async def test_an_unknown_service_is_refused_even_when_off() -> None:
    with pytest.raises(InvalidRequest, match="unknown network service"):
        await resolve(NetworkPolicy(services={"no-such-service": False}), ServiceTable())


async def test_a_name_that_does_not_resolve_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="cannot resolve") as raised:
        await resolve(NetworkPolicy(allow=["no-such-host.invalid:443"]), ServiceTable())
    assert raised.value.details == {"host": "no-such-host.invalid"}
