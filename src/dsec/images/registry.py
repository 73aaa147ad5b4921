"""A client of the OCI distribution API (v2), for pulls: manifests, configs and blobs, verified.

Why our own (small) client: a pull needs four things — manifest and index negotiation by
``Accept`` headers, the ``WWW-Authenticate`` challenge (Basic, or a Bearer token from the realm
the registry names), streaming blobs through redirects to blob storage, and a sha256 check of
every byte before anything is used. The registry is as untrusted as a sandbox: every document
is size-capped before it is parsed, every blob is checked against its digest while it streams
(into a layer being unpacked, which the store commits only after the check), and credentials
go only to the registry itself or to an HTTPS token realm.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import ipaddress
import json
import os
import re
import ssl
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx

from dsec.config import current
from dsec.images.reference import DOCKER_HUB, Reference
from dsec.protocol.errors import (
    DigestMismatch,
    ImageNotFound,
    InvalidRequest,
    RegistryDenied,
    RegistryError,
    RegistryUnreachable,
)

MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))
MAX_DOCUMENT = 4 << 20  # a manifest, an index or a config; Docker Hub's biggest are ~100 KiB
_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
_CHUNK = 1 << 20
# A challenge's parameters: key="quoted value" or key=token, comma-separated.
_PARAM = re.compile(r'\s*([A-Za-z][A-Za-z0-9_-]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,"]*))\s*,?')


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context (the CA bundle loaded once) for every pull: making it took 50–150 ms."""
    return httpx.create_ssl_context(trust_env=False)


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``WWW-Authenticate: Bearer realm="...",service="..."`` → ("bearer", {"realm": ...})."""
    scheme, _, rest = header.strip().partition(" ")
    params: dict[str, str] = {}
    position = 0
    while position < len(rest):
        match = _PARAM.match(rest, position)
        if match is None or match.end() == position:
            break
        quoted, bare = match.group(2), match.group(3)
        params[match.group(1).lower()] = (
            re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else bare or ""
        )
        position = match.end()
    return scheme.lower(), params


def plain_http(host: str) -> bool:
    """Whether ``host[:port]`` is reached over HTTP: loopback ones and those configured."""
    if host in current().registry_http:
        return True
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def credentials(registry: str) -> tuple[str, str] | None:
    """(user, password) for ``registry`` from the docker config file, if it has some."""
    path = current().registry_auth or Path(
        os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker"
    ) / "config.json"
    try:
        auths = json.loads(Path(path).read_text()).get("auths") or {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as exc:
        raise InvalidRequest(f"registry credentials file {path} is unreadable: {exc}") from None
    names = [registry, f"https://{registry}", f"http://{registry}", f"https://{registry}/v1/"]
    if registry == DOCKER_HUB:
        names = ["https://index.docker.io/v1/", "index.docker.io", "registry-1.docker.io", *names]
    for name in names:
        entry = auths.get(name)
        if not isinstance(entry, dict):
            continue
        if entry.get("auth"):
            try:
                user, sep, password = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
            except ValueError:
                raise InvalidRequest(f"{path}: the auth of {name} is not base64 user:password") from None
            if sep:
                return user, password
        if entry.get("username") and entry.get("password"):
            return str(entry["username"]), str(entry["password"])
    return None


class Registry:
    """One repository of one registry, for the length of a pull (a token is kept and reused)."""

    def __init__(self, ref: Reference) -> None:
        self.ref = ref
        scheme = "http" if plain_http(ref.api_host) else "https"
        self._base = f"{scheme}://{ref.api_host}/v2/{ref.repository}"
        self._client = httpx.Client(timeout=_TIMEOUT, follow_redirects=True, trust_env=False,
                                    verify=_tls())
        self._credentials = credentials(ref.registry)
        self._authorization: str | None = None

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def manifest(self, reference: str) -> tuple[str, dict[str, Any], str]:
        """The manifest (or index) named by a tag or digest: (digest, document, media type)."""
        with self._get(f"manifests/{reference}", accept=_ACCEPT) as response:
            data = self._read_capped(response, MAX_DOCUMENT, f"manifest {reference}")
            media_type = response.headers.get("content-type", "").split(";")[0].strip()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise DigestMismatch(f"{self.ref.registry}: manifest {reference} has digest {digest}",
                                 expected=reference, got=digest)
        document = self._json(data, f"manifest {reference}")
        media_type = document.get("mediaType") or media_type
        if document.get("schemaVersion") != 2 or media_type not in (*MANIFEST_TYPES, *INDEX_TYPES):
            raise RegistryError(f"{self.ref}: unsupported manifest (schemaVersion "
                                f"{document.get('schemaVersion')!r}, type {media_type!r}); "
                                "dsec pulls OCI and Docker schema 2 images",
                                registry=self.ref.registry)
        return digest, document, media_type

    def document(self, descriptor: Any) -> dict[str, Any]:
        """A small JSON blob (the image config), verified against its descriptor."""
        digest, size = check_descriptor(descriptor, MAX_DOCUMENT, self.ref)
        with self._get(f"blobs/{digest}") as response:
            data = self._read_capped(response, size, f"blob {digest}")
        got = "sha256:" + hashlib.sha256(data).hexdigest()
        if got != digest or len(data) != size:
            raise DigestMismatch(f"{self.ref}: blob {digest} has digest {got}", expected=digest, got=got)
        return self._json(data, f"blob {digest}")

    def blob(self, descriptor: Any, write: Callable[[bytes], object], max_size: int,
             progress: Callable[[int], None] = lambda done: None) -> None:
        """Stream a blob to ``write`` as it comes; then ``DigestMismatch`` unless its bytes
        matched the descriptor (the caller must not use what it was given before this returns)."""
        digest, size = check_descriptor(descriptor, max_size, self.ref)
        hasher, done = hashlib.sha256(), 0
        with self._get(f"blobs/{digest}") as response:
            try:
                for chunk in response.iter_bytes(_CHUNK):
                    done += len(chunk)
                    if done > size:
                        raise DigestMismatch(f"{self.ref}: blob {digest} is longer than its "
                                             f"{size} bytes", expected=digest, got="longer")
                    hasher.update(chunk)
                    write(chunk)
                    progress(done)
            except httpx.TransportError as exc:
                raise RegistryUnreachable(f"{self.ref}: blob {digest} download failed: {exc}",
                                          registry=self.ref.registry) from None
        got = "sha256:" + hasher.hexdigest()
        if got != digest or done != size:
            raise DigestMismatch(f"{self.ref}: blob {digest} has digest {got} ({done} of {size} "
                                 "bytes)", expected=digest, got=got)

    # --- HTTP ---------------------------------------------------------------------------

    def _get(self, path: str, accept: str | None = None) -> closing[httpx.Response]:
        """A streamed GET of ``path`` that succeeded (after authenticating once if asked to)."""
        url = f"{self._base}/{path}"
        headers = {"accept": accept} if accept else {}
        for attempt in range(2):
            if self._authorization:
                headers["authorization"] = self._authorization
            try:
                request = self._client.build_request("GET", url, headers=headers)
                response = self._client.send(request, stream=True)
            except httpx.TransportError as exc:
                raise RegistryUnreachable(f"{self.ref.registry} is unreachable: {exc}",
                                          registry=self.ref.registry) from None
            if response.status_code == 401 and attempt == 0:
                challenge = response.headers.get("www-authenticate", "")
                response.close()
                self._authenticate(challenge)
                continue
            if response.status_code == 200:
                return closing(response)
            response.close()
            status = response.status_code
            if status in (401, 403):
                raise RegistryDenied(
                    f"{self.ref}: the registry refused {'the credentials' if self._credentials else 'access without credentials'} "
                    f"(HTTP {status})", registry=self.ref.registry)
            if status == 404:
                raise ImageNotFound(f"{self.ref}: the registry has no {path.split('/')[0][:-1]} "
                                    f"{path.split('/', 1)[1]}", ref=str(self.ref))
            raise RegistryError(f"{self.ref}: HTTP {status} for {path}", registry=self.ref.registry)
        raise AssertionError("unreachable")  # pragma: no cover

    def _authenticate(self, challenge: str) -> None:
        scheme, params = parse_challenge(challenge)
        if scheme == "basic":
            if self._credentials is None:
                raise RegistryDenied(f"{self.ref.registry} needs credentials and dsec has none for it",
                                     registry=self.ref.registry)
            token = base64.b64encode(":".join(self._credentials).encode()).decode()
            self._authorization = f"Basic {token}"
        elif scheme == "bearer" and params.get("realm"):
            self._authorization = f"Bearer {self._token(params)}"
        else:
            raise RegistryDenied(f"{self.ref.registry} asks for authentication dsec does not "
                                 f"speak ({challenge[:100]!r})", registry=self.ref.registry)

    def _token(self, params: dict[str, str]) -> str:
        try:
            realm = httpx.URL(params["realm"])
        except httpx.InvalidURL:
            raise RegistryError(f"{self.ref.registry} names a token realm that is not a URL",
                                registry=self.ref.registry) from None
        query = {"scope": params.get("scope") or f"repository:{self.ref.repository}:pull"}
        if params.get("service"):
            query["service"] = params["service"]
        # Credentials go to an HTTPS realm or to the registry's own host, never elsewhere.
        same_host = realm.host == httpx.URL(f"http://{self.ref.api_host}/").host
        auth = (self._credentials if self._credentials and (realm.scheme == "https" or same_host)
                else None)
        try:
            response = self._client.get(realm, params=query, auth=auth)
        except httpx.TransportError as exc:
            raise RegistryUnreachable(f"{self.ref.registry}'s token realm {realm} is unreachable: "
                                      f"{exc}", registry=self.ref.registry) from None
        if response.status_code in (401, 403):
            raise RegistryDenied(
                f"{self.ref.registry}'s token realm refused the credentials (HTTP "
                f"{response.status_code})" if auth else
                f"{self.ref.registry} needs credentials and dsec has none for it (or none it "
                f"sends to {realm.scheme}://{realm.host})", registry=self.ref.registry)
        if response.status_code != 200 or len(response.content) > MAX_DOCUMENT:
            raise RegistryError(f"{self.ref.registry}'s token realm answered HTTP "
                                f"{response.status_code}", registry=self.ref.registry)
        body = self._json(response.content, "token")
        token = body.get("token") or body.get("access_token")
        if not isinstance(token, str) or not token:
            raise RegistryError(f"{self.ref.registry}'s token realm sent no token",
                                registry=self.ref.registry)
        return token

    def _read_capped(self, response: httpx.Response, limit: int, what: str) -> bytes:
        data = bytearray()
        try:
            for chunk in response.iter_bytes(_CHUNK):
                data += chunk
                if len(data) > limit:
                    raise RegistryError(f"{self.ref}: {what} is larger than {limit} bytes",
                                        registry=self.ref.registry)
        except httpx.TransportError as exc:
            raise RegistryUnreachable(f"{self.ref}: reading {what} failed: {exc}",
                                      registry=self.ref.registry) from None
        return bytes(data)

    def _json(self, data: bytes, what: str) -> dict[str, Any]:
        try:
            document = json.loads(data)
        except ValueError as exc:
            raise RegistryError(f"{self.ref}: {what} is not JSON: {exc}",
                                registry=self.ref.registry) from None
        if not isinstance(document, dict):
            raise RegistryError(f"{self.ref}: {what} is not a JSON object", registry=self.ref.registry)
        return document


_DIGEST = re.compile(r"^sha256:[a-f0-9]{64}$")


def check_descriptor(descriptor: Any, max_size: int, ref: Reference) -> tuple[str, int]:
    """(digest, size) of a descriptor the registry sent, refused unless well-formed and small."""
    digest = descriptor.get("digest") if isinstance(descriptor, dict) else None
    size = descriptor.get("size") if isinstance(descriptor, dict) else None
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise RegistryError(f"{ref}: a descriptor has no sha256 digest ({str(descriptor)[:100]})",
                            registry=ref.registry)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise RegistryError(f"{ref}: descriptor {digest} has no valid size", registry=ref.registry)
    if size > max_size:
        raise RegistryError(f"{ref}: blob {digest} is {size} bytes, over the limit of {max_size}",
                            registry=ref.registry)
    return digest, size
