"""A template killed an instant before a call: the call takes one of its workers and asks
for a replacement on the template's control socket, which the kernel closed with the
template's files before its pidfd said it exited. The ask is dropped, never raised to the
call, whose worker then runs it or dies with the template, and the call runs again on the
next template (tests/test_fn.py::test_a_dead_template_is_replaced met this race now and
then as an internal error: BrokenPipeError)."""

from __future__ import annotations

import socket
from pathlib import Path

from dsec.substrates.fn.fn_pool import Template


def test_an_ask_to_a_template_that_closed_its_end_is_dropped(tmp_path: Path) -> None:
    template = Template("k", 1, {}, tmp_path / "template.log", on_exit=lambda: None)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.close()  # as the kernel closes a killed template's files
    template._ctl = ours
    try:
        template.request(1)  # not BrokenPipeError
    finally:
        ours.close()
