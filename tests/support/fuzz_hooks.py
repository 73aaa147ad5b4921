"""Schemathesis hooks for tests/test_fuzz.py (loaded through ``SCHEMATHESIS_HOOKS``).

Generic over routes, so routes added later are fuzzed the same way:
- path parameters named ``sandbox_id``, ``process`` and ``trajectory`` get real ids (from the
  environment), so calls get past the 404 and reach the edge and the agent; except where the
  call would end the sandbox under test (stopping it, shortening its TTL);
- exec-like bodies get a short timeout, so no generated command can hold the run up;
- every 4xx/5xx body must be a typed dsec error (``{"error": {"code", "message", "details"}}``
  with a known code);
- a 5xx is a failure unless it is a typed refusal that is the API's answer, not a bug
  (``not_supported``: 501, ``capacity_exhausted``: 503, ``port_unavailable``: 502, nothing
  listens on the fuzzed sandbox port).
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis
from schemathesis.core.failures import ServerError

from dsec.protocol.errors import ERRORS

REAL_IDS = {"sandbox_id": "DSEC_FUZZ_SANDBOX", "process": "DSEC_FUZZ_PROCESS",
            "trajectory": "DSEC_FUZZ_TRAJECTORY"}
TYPED_REFUSALS = {"not_supported", "capacity_exhausted", "port_unavailable"}
EXEC_TIMEOUT_S = 5


def _ends_the_sandbox(operation: Any) -> bool:
    path, method = operation.path, operation.method.upper()
    return (method == "DELETE" and path == "/v1/sandboxes/{sandbox_id}") or path.endswith("/ttl")


@schemathesis.hook
def map_path_parameters(context: Any, path_parameters: dict[str, Any]) -> dict[str, Any]:
    if not path_parameters or (context.operation is not None and _ends_the_sandbox(context.operation)):
        return path_parameters
    return {name: os.environ.get(REAL_IDS.get(name, ""), value)
            for name, value in path_parameters.items()}


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    if isinstance(body, dict) and "command" in body:
        timeout = body.get("timeout_s")
        if timeout is None or (isinstance(timeout, (int, float)) and timeout > EXEC_TIMEOUT_S):
            body = {**body, "timeout_s": EXEC_TIMEOUT_S}
    return body


def _typed(response: Any) -> str | None:
    """The dsec error code of a response body, or None if it is not a typed dsec error."""
    try:
        body = response.json()
    except Exception:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    if not (isinstance(err, dict) and isinstance(err.get("code"), str)
            and isinstance(err.get("message"), str) and isinstance(err.get("details"), dict)):
        return None
    code = err["code"]
    return code if code in ERRORS or code.startswith("http_") else None


@schemathesis.check
def typed_dsec_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx/5xx answer is a typed dsec error a client can raise again."""
    if response.status_code >= 400 and _typed(response) is None:
        raise AssertionError(f"untyped {response.status_code} error body: {response.text[:500]!r}")
    return None


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    return not (isinstance(failure, ServerError) and _typed(response) in TYPED_REFUSALS)
