"""``Idempotency-Key`` on sandbox creates (native ``POST /v1/sandboxes`` and E2B's create).

Trainers retry a create that a timeout cut; without a key each retry is one more sandbox. With
a key, the first request of a project creates and every retry of it (same key, same project,
same request) gets that same sandbox: while the first is still creating the retry waits for
it; afterwards it is answered from the state store, also after a server restart or on another
API server of the same database. A key reused for a different request is refused
(``IdempotencyKeyReused``, 422, as the IETF Idempotency-Key draft recommends: the request is
well-formed but cannot be processed under that key); nothing is created.

A key lives ``KEY_TTL_S`` after its create, or as long as its sandbox's record, whichever is
shorter; a create that fails releases its key, so a retry creates afresh. A claim whose server
died mid-create (its process is gone, or it stopped renewing its lease) is taken over.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..protocol.errors import IdempotencyKeyReused, InvalidRequest, SandboxNotFound
from ..protocol.models import CreateRequest, SandboxInfo
from ..protocol.project_models import ROOT_PROJECT
from ..store.idempotency import IdempotencyStore

if TYPE_CHECKING:
    from .routing import Router

REPLAYED_HEADER = "Idempotent-Replayed"  # on an answer that an earlier request's create made
KEY_TTL_S = 24 * 3600.0
LEASE_S = 15.0  # a claim not renewed for this long belongs to a dead server
RENEW_S = 5.0
POLL_S = 0.1  # how often a waiting retry looks at the key
MAX_KEY = 255


def check_key(key: str) -> str:
    """A key is 1 to 255 visible ASCII characters (a UUID, or E2B's ``[a-z0-9-]+``)."""
    if not 1 <= len(key) <= MAX_KEY or not all("!" <= c <= "~" for c in key):
        raise InvalidRequest("Idempotency-Key must be 1 to 255 visible ASCII characters",
                             header="Idempotency-Key")
    return key


def _process_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22, starttime: pids are reused


def _this_owner() -> str:
    pid = os.getpid()
    return f"{socket.gethostname()}/{pid}/{_process_start(pid)}/{secrets.token_hex(4)}"


def _owner_dead(owner: str) -> bool:
    """Whether a claim's owner is certainly gone: a process of this host that no longer runs.
    An owner on another host is judged by its lease alone."""
    host, _, rest = owner.partition("/")
    pid, _, rest = rest.partition("/")
    start = rest.partition("/")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    return _process_start(int(pid)) != start


class Idempotency:
    def __init__(self, store: IdempotencyStore, router: Router) -> None:
        """Serves the router's creates (``Router.create_once``), which makes it."""
        self.store = store
        self.router = router
        self.owner = _this_owner()

    def _scope(self) -> str:
        access = self.router.access
        return (access.caller() if access is not None else None) or ROOT_PROJECT

    async def create(self, key: str, kind: str, req: CreateRequest,
                     make: Callable[[], Awaitable[SandboxInfo]]) -> tuple[SandboxInfo, bool]:
        """The sandbox of ``key``: made by ``make`` once, or the one made before (then True).
        ``kind`` names the front-end: a key is one request of one front-end."""
        scope, digest = self._scope(), _digest(kind, req)
        while True:
            claim = self.store.claim(scope, check_key(key), digest, self.owner, LEASE_S, KEY_TTL_S)
            if claim.state == "pending" and claim.owner is not None and _owner_dead(claim.owner):
                claim = self.store.take_over(scope, key, claim.owner, self.owner, LEASE_S)
            if claim.state == "mismatch":
                raise IdempotencyKeyReused("this Idempotency-Key was used for a different create "
                                           "request; use a new key for a new sandbox", key=key)
            if claim.state == "done":
                assert claim.sandbox_id is not None
                info = self._existing(claim.sandbox_id)
                if info is not None:
                    return info, True
                self.store.forget(scope, key, claim.sandbox_id)
            elif claim.state == "claimed":
                info = await self._create(scope, key, make)
                if info is not None:
                    return info, False
            else:  # another request is creating under the key: wait for its sandbox
                await asyncio.sleep(POLL_S)

    async def _create(self, scope: str, key: str,
                      make: Callable[[], Awaitable[SandboxInfo]]) -> SandboxInfo | None:
        """Create under a claimed key, renewing its lease meanwhile. None if the claim was
        lost (this server stalled past its lease and another took over): the sandbox made
        here is stopped and the caller joins the other one."""
        renewing = asyncio.create_task(self._renew(scope, key))
        try:
            info = await make()
        except BaseException:
            self.store.release(scope, key, self.owner)
            raise
        finally:
            renewing.cancel()
        if self.store.complete(scope, key, self.owner, info.id):
            return info
        await self.router.owner(info.id).stop(info.id, "stopped", "a duplicate of an idempotent "
                                              "create whose key another server took over")
        return None

    async def _renew(self, scope: str, key: str) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            self.store.renew(scope, key, self.owner, LEASE_S)

    def _existing(self, sandbox_id: str) -> SandboxInfo | None:
        """The sandbox a key names, whatever its state; None once its record is gone."""
        try:
            edge = self.router.owner(sandbox_id)
            return edge.info(edge.get_row(sandbox_id))
        except SandboxNotFound:
            return None


def _digest(kind: str, req: CreateRequest) -> str:
    canonical = json.dumps({"kind": kind, "request": req.model_dump(mode="json")},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
