"""The SDK's error tree: builtin parents where Python has one, and every error intact after
the trips it makes (pickle across Ray from a cluster edge, JSON across HTTP)."""

from __future__ import annotations

import pickle

import pytest
from ray.exceptions import RayTaskError

from dsec.cluster.remote import _unwrap
from dsec.protocol.errors import (
    ERRORS,
    CommandTimeout,
    DSecError,
    FileNotFound,
    error_from_json,
)


def test_builtin_parents() -> None:
    with pytest.raises(FileNotFoundError):
        raise FileNotFound("/work/a: no such file or directory", path="/work/a")
    with pytest.raises(TimeoutError):
        raise CommandTimeout("command timed out after 1s", timeout_s=1)
    assert issubclass(FileNotFound, DSecError) and issubclass(CommandTimeout, DSecError)


@pytest.mark.parametrize("cls", ERRORS.values(), ids=lambda c: c.code)
def test_every_error_survives_pickle_json_and_ray(cls: type[DSecError]) -> None:
    err = cls("it failed", path="/p", sandbox_id="sb-e1-0")
    for back in (pickle.loads(pickle.dumps(err)), error_from_json(err.to_json())):
        assert type(back) is cls
        assert (str(back), back.message, back.details) == (str(err), err.message, err.details)
    wrapped = RayTaskError("call", "traceback", err)
    assert _unwrap(wrapped) is err
    unwrapped = _unwrap(pickle.loads(pickle.dumps(wrapped)))
    assert type(unwrapped) is cls and unwrapped.details == err.details
    assert isinstance(wrapped.as_instanceof_cause(), cls)
