"""A harbor environment whose trials run in dsec sandboxes.

harbor loads a custom environment by import path: ``harbor run --env
dsec.integrations.harbor:DsecEnvironment`` (options with ``--ek key=value``); the server and
key come from ``DSEC_URL`` and ``DSEC_API_KEY`` as for any SDK use. One sandbox per
environment: ``start`` creates it from the task's ``[environment] docker_image`` (a dsec image
name; the ``image`` option overrides it) with the task's cpus, memory and storage, ``stop``
removes it, ``exec`` runs ``bash -c`` in it, files and directories move through dsec's file
and archive calls. A directory downloaded from the sandbox is a sandbox-made archive, so it is
extracted by the SDK member by member under the destination only (``UnsafeArchive``
otherwise); harbor's filtered downloads (logs with include/exclude, artifacts with excludes),
which harbor itself packs with the image's tar, which the sandbox can replace, go through the
same extraction and are filtered on the host. harbor's network policy per phase maps onto dsec's egress policy, switched in
place between phases (``set_network``): no-network is ``"none"``, an allowlist becomes
dsec ``allow`` rules (host names, IPv4 addresses and networks), public is the
``public_network`` option. A command for another user runs through dsec's own ``su``.

Not served, each with a typed error before anything is created: building the task's
``environment/Dockerfile`` or compose file (dsec's Dockerfile builds are issue 16), a user
given as a numeric uid. Needs ``pip install harbor`` (Python 3.12 or newer) beside
dsec (tested with 0.26.0).
"""

from __future__ import annotations

import codecs
import shutil
import tempfile
from collections.abc import Callable, Sequence
from fnmatch import fnmatch
from ipaddress import IPv4Network
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.environments.definition import COMPOSE_FILE_NAME, DOCKERFILE_NAME
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import NetworkMode, NetworkPolicy
from harbor.utils.path_filter import filter_paths_by_patterns
from pydantic import Field

from ..client.aio import AsyncClient, Sandbox
from ..protocol.errors import InvalidRequest, NotSupported, UnsafeArchive

ROOT_USERS = (None, "root", 0, "0")
# Not the internet: this host, its LAN and its cloud's metadata service (169.254.169.254, whose
# credentials an agent must not read) among them. harbor's "public" allows the rest.
NOT_PUBLIC = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
              "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/3")


def public_ipv4() -> list[str]:
    """Every IPv4 network but ``NOT_PUBLIC``, as CIDR rules (73 of them)."""
    nets = [IPv4Network("0.0.0.0/0")]
    for excluded in map(IPv4Network, NOT_PUBLIC):
        nets = [part for net in nets
                for part in (net.address_exclude(excluded) if excluded.subnet_of(net) else [net])]
    return sorted(str(net) for net in nets)

BUSYBOX = "/.dsec/bin/busybox"  # dsec's read-only tools in every sandbox (docs/SECURITY.md)


class DsecOptions(EnvironmentOptions):
    """What ``--ek`` may set for the dsec environment."""

    image: str | None = Field(None, description="dsec image to start instead of the task's docker_image")
    substrate: str = Field("container", description="container, microvm or vm")
    ttl_s: int = Field(7200, ge=1, description="sandbox lifetime, a bound if harbor never stops it")
    pids: int | None = Field(None, description="process limit; None: the server's default")
    public_network: Any = Field(
        default_factory=lambda: {"allow": public_ipv4()},
        description="dsec network policy for harbor's 'public' mode; by default every public "
                    "IPv4 address (not private, loopback, link-local or CGNAT networks)")


class DsecEnvironment(BaseEnvironment):
    """harbor's ``BaseEnvironment`` over one dsec sandbox (async SDK)."""

    options_model = DsecOptions
    options: DsecOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._client: AsyncClient | None = None
        self._sandbox: Sandbox | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "dsec"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(
            disable_internet=True, network_allowlist=True, network_allowlist_hostnames=True,
            network_allowlist_ipv4_addresses=True, network_allowlist_ipv4_cidrs=True,
            dynamic_network_policy=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True,
                                               fractional_cpus=True)

    def _validate_definition(self) -> None:
        self._image()

    def _image(self) -> str:
        """The dsec image: the ``image`` option, else the task's docker_image."""
        image = self.options.image or self.task_env_config.docker_image
        if image:
            return image
        built = [name for name in (DOCKERFILE_NAME, COMPOSE_FILE_NAME)
                 if (self.environment_dir / name).exists()]
        raise NotSupported(
            f"task {self.environment_name!r} names no image: dsec cannot build its "
            f"{' or '.join(built) or 'environment definition'} yet (Dockerfile builds are "
            "dsec issue 16); set [environment] docker_image or --ek image=<dsec image>",
            environment_dir=str(self.environment_dir))

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            raise RuntimeError("the dsec sandbox is not running: start the environment first")
        return self._sandbox

    def _network(self, policy: NetworkPolicy) -> Any:
        if policy.network_mode == NetworkMode.NO_NETWORK:
            return "none"
        if policy.network_mode == NetworkMode.ALLOWLIST:
            return {"allow": list(policy.allowed_hosts)}
        return self.options.public_network

    async def start(self, force_build: bool) -> None:
        if force_build and (self.environment_dir / DOCKERFILE_NAME).exists():
            raise NotSupported("force_build: dsec cannot build the task's Dockerfile yet "
                               "(Dockerfile builds are dsec issue 16)")
        self._client = AsyncClient()
        self._sandbox = await self._client.create(
            self.options.substrate, self._image(),
            cpu=self._effective_cpus, memory_mb=self._effective_memory_mb,
            disk_mb=self._effective_storage_mb, pids=self.options.pids, ttl_s=self.options.ttl_s,
            network=self._network(self.network_policy), env=self._startup_env() or None,
            labels={"harness": "harbor", "session": self.session_id})
        if self.task_env_config.workdir:  # as docker makes an image's WORKDIR
            await self._sandbox.mkdir(self.task_env_config.workdir, parents=True)
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        """Remove the sandbox (dsec sandboxes do not outlive ``stop``, whatever ``delete``)."""
        sandbox, self._sandbox = self._sandbox, None
        client, self._client = self._client, None
        try:
            if sandbox is not None:
                await sandbox.stop()
        finally:
            if client is not None:
                await client.aclose()

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        await self.sandbox.set_network(self._network(network_policy))

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        """Run ``bash -c command`` (as harbor's docker environment does), as root or as the
        named ``user``, streaming its output to a trial's output callback if one is set; a
        timeout raises dsec's ``CommandTimeout`` (a ``TimeoutError``) after killing the
        command."""
        argv = _as_user(self._resolve_user(user), command)
        env, cwd = self._merge_env(env), cwd or self.task_env_config.workdir
        callback = self._output_callback()
        if callback is None:
            result = await self.sandbox.run(argv, env=env, cwd=cwd, timeout_s=timeout_sec)
        else:  # a trial streams this phase's output live
            stream = self.sandbox.stream(argv, env=env, cwd=cwd, timeout_s=timeout_sec)
            decoders = {name: codecs.getincrementaldecoder("utf-8")("replace")
                        for name in ("stdout", "stderr")}
            async for chunk in stream:
                if text := decoders[chunk.stream].decode(chunk.data):
                    await callback(text, chunk.stream)
            for name, decoder in decoders.items():  # a sequence cut at the end
                if text := decoder.decode(b"", final=True):
                    await callback(text, name)
            result = await stream.wait()
        return ExecResult(stdout=result.stdout, stderr=result.stderr,
                          return_code=result.exit_code)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        source = Path(source_path)
        await self.sandbox.mkdir(str(Path(target_path).parent), parents=True)
        await self.sandbox.write_file(target_path, source.read_bytes(),
                                      mode=source.stat().st_mode & 0o777)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        if not Path(source_dir).is_dir():
            raise InvalidRequest(f"upload_dir: {source_dir} is not a directory")
        await self.sandbox.upload(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self.sandbox.read_file(source_path)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self.sandbox.download(source_dir, target_dir)

    # harbor's own filtered downloads pack a tar with the image's tar in the sandbox and unpack
    # it with tarfile's data filter (bypassed on some Pythons: see protocol/archive.py); here
    # they go through download_dir's checked extraction into a staging directory instead,
    # and the selected regular files are copied from there.

    async def download_dir_with_exclusions(self, *, source_dir: str, target_dir: Path | str,
                                           exclude: list[str]) -> None:
        """Like ``tar --exclude``: a pattern drops a file if it matches the file's relative
        path or any part of it (a directory's name drops what is under it)."""
        await self._download_selected(
            source_dir, target_dir, lambda name: not any(_tar_excludes(p, name) for p in exclude))

    async def download_dir_filtered(self, *, source_dir: str, target_dir: Path | str,
                                    include: Sequence[str] | None = None,
                                    exclude: Sequence[str] | None = None,
                                    protect: Sequence[str] | None = None) -> None:
        def keep(name: str) -> bool:
            return name in (protect or ()) or bool(
                filter_paths_by_patterns([name], include=include, exclude=exclude))
        await self._download_selected(source_dir, target_dir, keep)

    async def _download_selected(self, source_dir: str, target_dir: Path | str,
                                 keep: Callable[[str], bool]) -> None:
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as staging:
            staged = Path(staging)
            await self.download_dir(source_dir, staged)
            for path in sorted(staged.rglob("*")):
                name = path.relative_to(staged).as_posix()
                if path.is_symlink() or not path.is_file() or not keep(name):
                    continue
                destination = target / name
                if not destination.resolve().is_relative_to(target.resolve()):
                    raise UnsafeArchive(f"{name} would be written outside {target}", member=name)
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, destination, follow_symlinks=False)


def _as_user(user: str | int | None, command: str) -> list[str]:
    """The argv running ``command`` in bash as ``user``, as ``docker exec -u`` would (the
    user's HOME, USER, LOGNAME and SHELL, the rest of the environment kept): dsec's own
    busybox ``su``, by absolute path, not the image's. ``su`` takes a name, not a uid."""
    if user in ROOT_USERS:
        return ["bash", "-c", command]
    if isinstance(user, int) or user.isdigit():
        raise NotSupported(f"harbor asked for uid {user}: dsec switches users by name only",
                           user=str(user))
    return [BUSYBOX, "su", "-s", "/bin/bash", str(user), "-c", command]


def _tar_excludes(pattern: str, name: str) -> bool:
    parts = name.split("/")
    return any(fnmatch(
        "/".join(parts[i:j]), pattern) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1))
