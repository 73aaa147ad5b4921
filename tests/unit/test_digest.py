"""Step digests: what identifies a call in a trajectory, on the SDK and the server alike.

Expected texts and digests are written out here from the documented rules (canonical JSON:
sorted keys, no spaces, UTF-8 kept; the payload as its SHA-256 and size), and hashed with
hashlib, not taken from the code under test.
"""

from __future__ import annotations

import base64
import hashlib
import math

import pytest

from dsec.protocol.digest import StepRequest, call_arguments, canonical_json, step
from dsec.protocol.models import ExecRequest
from dsec.protocol.ops import BY_STEP


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_canonical_text_and_digest_follow_the_documented_rules() -> None:
    request = StepRequest("write", {"path": "a.txt", "mode": 420, "append": False}, b"hello")
    text = ('{"op":"write","params":{"append":false,"mode":420,"path":"a.txt"},'
            f'"payload":{{"sha256":"{sha256(b"hello")}","size":5}}}}')
    assert request.canonical == text
    assert request.digest == "sha256:" + sha256(text.encode())
    assert request.describe() == {"op": "write", "params": {"path": "a.txt", "mode": 420, "append": False},
                                  "payload": {"size": 5, "sha256": sha256(b"hello")}}


def test_parameter_order_does_not_change_the_digest_at_any_depth() -> None:
    one = StepRequest("exec", {"command": ["ls"], "env": {"A": "1", "B": "2"}, "cwd": None})
    other = StepRequest("exec", {"cwd": None, "env": {"B": "2", "A": "1"}, "command": ["ls"]})
    assert one.digest == other.digest
    # ... but list order is part of the call
    assert StepRequest("exec", {"command": ["ls", "-l"]}).digest != StepRequest("exec", {"command": ["-l", "ls"]}).digest


def test_the_payload_enters_as_its_sha256_and_size() -> None:
    big = bytes(range(256)) * 8192  # 2 MiB
    request = StepRequest("upload", {"path": "/work"}, big)
    assert request.payload_ref == {"size": len(big), "sha256": sha256(big)}
    assert len(request.canonical) < 200  # the bytes themselves are not in the text
    assert request.digest == StepRequest("upload", {"path": "/work"}, bytes(big)).digest
    assert request.digest != StepRequest("upload", {"path": "/work"}, big[:-1] + b"\x00").digest
    # no payload and an empty payload are different calls
    assert StepRequest("write", {}, None).canonical == '{"op":"write","params":{},"payload":null}'
    assert StepRequest("write", {}, b"").payload_ref == {"size": 0, "sha256": sha256(b"")}


def test_a_path_is_digested_as_the_client_wrote_it() -> None:
    assert step("read_file", path="a.txt").digest != step("read_file", path="/work/a.txt").digest
    assert step("read_file", path="a.txt").params == {"path": "a.txt"}


def test_non_ascii_text_is_kept_as_utf8() -> None:
    request = StepRequest("write", {"path": "/work/café-日本.txt"})
    assert "café-日本" in request.canonical
    assert "\\u" not in request.canonical
    assert request.digest == "sha256:" + sha256(
        '{"op":"write","params":{"path":"/work/café-日本.txt"},"payload":null}'.encode())


@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf])
def test_nan_and_infinities_are_refused(number: float) -> None:
    with pytest.raises(ValueError):
        canonical_json({"timeout_s": number})
    with pytest.raises(ValueError):
        _ = StepRequest("exec", {"timeout_s": number}).digest


def test_canonical_json_has_no_spaces_and_sorted_keys() -> None:
    assert canonical_json({"b": [1, {"d": 2, "c": None}], "a": True}) == '{"a":true,"b":[1,{"c":null,"d":2}]}'


def test_an_exec_request_round_trips_with_stdin_as_the_payload() -> None:
    request = ExecRequest(command=["python3", "-c", "print(1)"], env={"A": "é"}, cwd="/work/x",
                          stdin_b64=base64.b64encode(b"\x00input\xff").decode(), timeout_s=5,
                          max_output_bytes=1000, session="s1")
    logged = step("run", req=request)
    assert logged.op == "exec"
    assert logged.payload == b"\x00input\xff"
    assert "stdin_b64" not in logged.params
    assert logged.params["command"] == ["python3", "-c", "print(1)"] and logged.params["session"] == "s1"
    assert call_arguments(BY_STEP["exec"], logged) == {"req": request}

    without_stdin = ExecRequest(command="true")
    logged = step("start_process", req=without_stdin)
    assert logged.payload is None and logged.op == "start"
    assert call_arguments(BY_STEP["start"], logged) == {"req": without_stdin}


def test_defaults_filled_in_by_the_wire_model_are_part_of_the_call() -> None:
    # The request is digested after the model filled in its defaults: leaving a default out
    # or spelling it is the same call; another value is not.
    assert step("run", req=ExecRequest(command="true")).digest == \
        step("run", req=ExecRequest(command="true", timeout_s=60.0)).digest
    assert step("run", req=ExecRequest(command="true")).digest != \
        step("run", req=ExecRequest(command="true", timeout_s=61.0)).digest
    assert step("run", req=ExecRequest(command="true")).digest != \
        step("start_process", req=ExecRequest(command="true")).digest
    stdin = base64.b64encode(b"x").decode()
    assert step("run", req=ExecRequest(command="cat", stdin_b64=stdin)).digest != \
        step("run", req=ExecRequest(command="cat")).digest
