"""Secrets the server keeps in its state directory (MAC keys of tokens it hands out: envd access
tokens, sandbox port tokens), so that tokens outlive a restart like the sandboxes do."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def load_secret(path: Path) -> bytes:
    """The 32 random bytes kept (hex, mode 0600) at ``path``, made on first use."""
    try:
        return bytes.fromhex(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        pass
    secret = secrets.token_bytes(32)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    os.replace(tmp, path)
    return secret
