"""API keys for the compatibility front-ends, and the per-sandbox envd access tokens.

The E2B and SandboxFusion clients authenticate in their own ways: E2B's SDK sends
``X-API-Key`` to the control plane and a per-sandbox ``X-Access-Token`` (returned at create
as ``envdAccessToken``) to the data plane; SandboxFusion clients send nothing but can put
credentials in the endpoint URL (``http://user:KEY@host/...``), which ``requests`` and
``aiohttp`` turn into HTTP Basic auth. Any dsec API key works in each of these places.

Access tokens are the sandbox id with ``HMAC-SHA256(secret, sandbox id)``: verifiable
without state, valid as long as the sandbox, and never the API key itself. The secret is kept root-only in the
state directory, so tokens survive a server restart like the sandboxes do.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path
from typing import Callable, Mapping

from ..store.secret import load_secret
from ..store.sqlite import StateStore


class Keys:
    def __init__(self, store: StateStore, state_dir: Path,
                 enter: Callable[[str], None] | None = None) -> None:
        """``enter(key id)`` makes a valid key's project the caller's (see control/projects.py)."""
        self.store = store
        self._known: dict[str, str] = {}  # secret -> key id
        self._secret = load_secret(state_dir / "compat.secret")
        self._enter = enter

    def valid(self, secret: str | None) -> bool:
        if not secret:
            return False
        key_id = self._known.get(secret) or self.store.key_for_secret(secret)
        if key_id is None:
            return False
        self._known[secret] = key_id  # keys are never revoked yet
        if self._enter is not None:
            self._enter(key_id)
        return True

    def from_headers(self, headers: Mapping[str, str]) -> str | None:
        """The key in ``X-API-Key``, ``Authorization: Bearer KEY`` or ``Authorization: Basic``
        (the key as the password, or as the user name with an empty password)."""
        get = headers.get
        if key := get("x-api-key"):
            return str(key)
        scheme, _, value = str(get("authorization", "")).partition(" ")
        if scheme.lower() == "bearer":
            return value.strip() or None
        if scheme.lower() == "basic":
            try:
                user, _, password = base64.b64decode(value.strip()).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return None
            return password or user or None
        return None

    def access_token(self, sandbox_id: str) -> str:
        """``<sandbox id>.<MAC>``: the id in clear lets a request that names no sandbox
        (older SDKs after ``Sandbox.connect`` send no ``E2b-Sandbox-Id``) still be routed."""
        mac = hmac.new(self._secret, sandbox_id.encode(), hashlib.sha256).hexdigest()
        return f"{sandbox_id}.{mac}"

    def valid_access_token(self, sandbox_id: str, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(self.access_token(sandbox_id), str(token))

    @staticmethod
    def sandbox_of_token(token: str | None) -> str | None:
        sandbox_id, dot, _ = (token or "").rpartition(".")
        return sandbox_id if dot else None
