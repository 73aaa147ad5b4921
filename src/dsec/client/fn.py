"""The fn substrate's calls, for the SDK and the server: a function call (cloudpickle over
``POST /v1/call``), ``run_code`` for OJ-style checks (``POST /v1/run_code``), and ``map``.

A call's body is ``cloudpickle.dumps((fn, args, kwargs))`` and its answer the pickled return
value. That pickle is made by the code that ran in the call (a grader's, and the model code
it runs), so it is decoded as plain data by default (``plain.loads``: builtin values only,
nothing imported or called, sizes capped); ``trusted_result=True`` unpickles it fully, for
callers whose calls run no code they do not trust.
"""

from __future__ import annotations

import asyncio
import sys
import sysconfig
from pathlib import Path
from typing import Any, Callable, Iterable

import cloudpickle

from ..protocol.errors import DSecError, NotSupported
from ..protocol.fn import CodeResult, RunCodeRequest
from . import plain
from .transport import Transport


def check_substrate(substrate: str) -> None:
    if substrate != "fn":
        raise NotSupported(f"function calls run on the fn substrate, not {substrate!r}",
                           substrate=substrate)


def _ship_by_value(fn: Callable[..., Any]) -> None:
    """cloudpickle pickles a function of an importable module by reference, and the image
    has no copy of the caller's own modules: those (not the standard library's or installed
    packages') go by value."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    if module is None or path is None or module.__name__ in _BY_VALUE:
        return
    resolved = Path(path).resolve()
    if not any(resolved.is_relative_to(root) for root in _INSTALLED):
        cloudpickle.register_pickle_by_value(module)
        _BY_VALUE.add(module.__name__)


_BY_VALUE: set[str] = set()
_INSTALLED = {Path(sysconfig.get_paths()[k]).resolve()
              for k in ("stdlib", "platstdlib", "purelib", "platlib")}


async def call(transport: Transport, fn: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any], image: str, timeout_s: float, trusted_result: bool) -> Any:
    _ship_by_value(fn)
    payload = cloudpickle.dumps((fn, args, kwargs))
    response = await transport.request("POST", "/v1/call", content=payload,
                                       params={"image": image, "timeout_s": timeout_s})
    return cloudpickle.loads(response.content) if trusted_result else plain.loads(response.content)


async def run_code(transport: Transport, req: RunCodeRequest) -> CodeResult:
    return CodeResult.model_validate(await transport.json("POST", "/v1/run_code", json=req.model_dump()))


async def map_calls(transport: Transport, fn: Callable[..., Any], items: Iterable[Any],
                    concurrency: int, image: str, timeout_s: float,
                    return_exceptions: bool, trusted_result: bool) -> list[Any]:
    gate = asyncio.Semaphore(concurrency)

    async def one(item: Any) -> Any:
        async with gate:
            try:
                return await call(transport, fn, (item,), {}, image, timeout_s, trusted_result)
            except DSecError as exc:
                if return_exceptions:
                    return exc
                raise

    return list(await asyncio.gather(*(one(item) for item in items)))
