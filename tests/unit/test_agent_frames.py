"""The agent's frame codec against the format docs/AGENT_PROTOCOL.md states:
``u32 BE body length | body``, ``body = u8 type | field*``,
``field = u8 key length | key | u32 BE value length | value``, integers in decimal ASCII.
The expected bytes are written out by hand."""

from __future__ import annotations

import asyncio

import pytest

from dsec.agent.protocol import MAX_FRAME, Frame, decode, encode, read_frame

# type "E"; argv = "ls" (str: UTF-8); timeout_ms = 5000 (int: decimal ASCII); stdin = b"\x00\xff"
BODY = (b"E"
        + b"\x04" + b"argv" + b"\x00\x00\x00\x02" + b"ls"
        + b"\x0a" + b"timeout_ms" + b"\x00\x00\x00\x04" + b"5000"
        + b"\x05" + b"stdin" + b"\x00\x00\x00\x02" + b"\x00\xff")
FRAME = b"\x00\x00\x00\x2b" + BODY  # 1 + (1+4+4+2) + (1+10+4+4) + (1+5+4+2) = 43 bytes of body


def test_a_frame_is_encoded_as_documented() -> None:
    assert len(BODY) == 43
    assert encode("E", [("argv", "ls"), ("timeout_ms", 5000), ("stdin", b"\x00\xff")]) == FRAME
    assert encode("P") == b"\x00\x00\x00\x01P"  # a frame without fields
    assert encode("W", [("data", "é")]) == b"\x00\x00\x00\x0cW\x04data\x00\x00\x00\x02\xc3\xa9"


def test_a_frame_decodes_with_its_accessors() -> None:
    frame = decode(BODY)
    assert frame == Frame("E", (("argv", b"ls"), ("timeout_ms", b"5000"), ("stdin", b"\x00\xff")))
    assert frame.get("argv") == b"ls" and frame.get("missing") is None
    assert frame.num("timeout_ms") == 5000 and frame.num("missing", 7) == 7
    assert frame.text("argv") == "ls" and frame.text("missing", "d") == "d"
    assert frame.text("stdin") == "\x00\ufffd"  # not UTF-8: replaced, never an exception
    assert frame.data("stdin") == b"\x00\xff" and frame.data("missing") == b""


def test_repeated_keys_keep_their_order() -> None:
    body = encode("E", [("arg", "a"), ("env", "X=1"), ("arg", "b"), ("arg", "")])[4:]
    frame = decode(body)
    assert frame.all("arg") == [b"a", b"b", b""] and frame.get("arg") == b"a"
    assert frame.num("pid", base=16, default=-1) == -1
    assert decode(encode("K", [("mask", "ff")])[4:]).num("mask", base=16) == 255


@pytest.mark.parametrize("body", [
    b"",  # no type
    b"E\x04arg",  # key cut short
    b"E\x04argv\x00\x00",  # value length cut short
    b"E\x04argv\x00\x00\x00\x05ls",  # value shorter than its length
])
def test_a_truncated_body_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError):
        decode(body)


def test_a_frame_over_the_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        encode("W", [("data", b"\x00" * MAX_FRAME)])


async def test_frames_are_read_from_a_stream_one_by_one() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(FRAME + encode("P"))
    reader.feed_eof()
    assert (await read_frame(reader)).type == "E"
    assert (await read_frame(reader)) == Frame("P", ())
    with pytest.raises(asyncio.IncompleteReadError):
        await read_frame(reader)


@pytest.mark.parametrize("length", [0, MAX_FRAME + 1, 0xFFFFFFFF])
async def test_a_bad_length_prefix_is_refused_before_reading_the_body(length: int) -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(length.to_bytes(4, "big"))
    reader.feed_eof()
    with pytest.raises(ValueError, match="bad frame length"):
        await read_frame(reader)
