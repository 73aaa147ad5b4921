"""A SWE-ReX deployment whose runtime is a dsec sandbox: ``start()`` creates the sandbox and
hands back swe-rex's own ``RemoteRuntime`` pointed at dsec's SWE-ReX front-end
(``/swerex/<sandbox id>``, see compat/swerex.py); ``stop()`` closes the runtime and stops the
sandbox. Harnesses that take an ``AbstractDeployment`` (SWE-agent, mini-swe-agent's
``swerex_*`` environments) use it in place of ``DockerDeployment``.

The server and key come from ``url``/``api_key`` or, as for any SDK use, ``DSEC_URL`` and
``DSEC_API_KEY``; the server must be reachable over HTTP (``dsec serve --host ... --port ...``), since ``RemoteRuntime``
speaks HTTP only. Needs ``pip install dsec[swerex]`` (tested with swe-rex 1.4.0).
"""

from __future__ import annotations

import logging
from typing import Any

from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import DeploymentNotStartedError
from swerex.runtime.abstract import IsAliveResponse
from swerex.runtime.remote import RemoteRuntime

from ..client.aio import AsyncClient, Sandbox

SWEREX_PREFIX = "/swerex"  # compat/__init__.py mounts the front-end there


class DsecDeployment(AbstractDeployment):
    def __init__(self, *, image: str = "debian-minbase", substrate: str = "container",
                 url: str | None = None, api_key: str | None = None,
                 runtime_timeout: float = 60.0, logger: logging.Logger | None = None,
                 **create: Any) -> None:
        """``create``: further options of ``AsyncClient.create`` (``cpu``, ``memory_mb``,
        ``ttl_s``, ``network``, ``env``, ...)."""
        self.url, self.api_key = url, api_key
        self.image, self.substrate, self.create_options = image, substrate, create
        self.runtime_timeout = runtime_timeout
        self.logger = logger or logging.getLogger("dsec.swerex")
        self._hooks = CombinedDeploymentHook()
        self._client: AsyncClient | None = None
        self.sandbox: Sandbox | None = None
        self._runtime: RemoteRuntime | None = None

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def runtime(self) -> RemoteRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self, *args: Any, **kwargs: Any) -> None:
        self._hooks.on_custom_step("Starting dsec sandbox")
        self._client = AsyncClient(self.url, self.api_key, autostart=False)
        url, key = await self._client.endpoint()
        if not url.startswith(("http://", "https://")):
            await self.stop()
            raise ValueError("SWE-ReX's RemoteRuntime needs the dsec server's http(s) URL "
                             f"(url= or DSEC_URL), not {url!r}")
        self.sandbox = await self._client.create(
            self.substrate, self.image, labels={"harness": "swe-rex"}, **self.create_options)
        self._runtime = RemoteRuntime(host=f"{url}{SWEREX_PREFIX}/{self.sandbox.id}",
                                      auth_token=key, timeout=self.runtime_timeout,
                                      logger=self.logger)
        await self._runtime.wait_until_alive(timeout=self.runtime_timeout)

    async def stop(self, *args: Any, **kwargs: Any) -> None:
        """Close the runtime's sessions, stop the sandbox; safe to call twice."""
        runtime, self._runtime = self._runtime, None
        sandbox, self.sandbox = self.sandbox, None
        client, self._client = self._client, None
        try:
            if runtime is not None:
                await runtime.close()
        finally:
            try:
                if sandbox is not None:
                    await sandbox.stop()
            finally:
                if client is not None:
                    await client.aclose()
