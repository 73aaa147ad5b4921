"""A SWE-ReX bash session: the image's bash on a dsec terminal (``Edge.start_pty``), typed
into with ``send_stdin`` and read back through ``attach``; the line protocol is
``swerex_shell``'s.

Semantics follow SWE-ReX's ``BashSession``: a command runs until its prompt or one of its
``expect`` strings appears, or ``timeout`` passes (``CommandTimeoutError``; the command keeps
running, as in SWE-ReX, until an interrupt); ``check`` decides what a non-zero exit does;
an interactive command is typed as is (input for the program in the foreground, e.g. a
``python3`` REPL or a ``read``) and waits for its ``expect`` strings or the prompt;
``bash_interrupt`` types Ctrl-C (up to ``n_retry`` times), then falls back to Ctrl-Z and
``kill -9 %1``. One command at a time per session.

A session lives in the API server process that created it, for as long as its bash does.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

from ..agent.client import Output
from ..edge.edge import Edge
from ..protocol.errors import DSecError
from ..protocol.models import PtyRequest
from .swerex_models import BashAction, BashInterruptAction, SwerexError, observation
from .swerex_shell import Match, Transcript, command_line, new_nonce, setup_line

STARTUP_MIN_S = 10.0  # a sandbox's bash and its rc files take longer than SWE-ReX's 1 s default
DEFAULT_TIMEOUT_S = 30.0  # pexpect's, which SWE-ReX's None falls back to
INTERRUPT_WAIT_S = 0.2


class BashSession:
    def __init__(self, edge: Edge, sandbox_id: str, process: str) -> None:
        self.edge, self.sandbox_id, self.process = edge, sandbox_id, process
        self.lock = asyncio.Lock()
        self.nonce: str | None = None
        self.transcript = Transcript()
        self.ended = False
        self._changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, edge: Edge, sandbox_id: str, sources: list[str],
                    startup_timeout: float) -> tuple[BashSession, str]:
        proc = await edge.start_pty(sandbox_id, PtyRequest(command=["/usr/bin/env", "bash"],
                                                           cols=200, rows=50))
        session = cls(edge, sandbox_id, proc.id)
        try:
            wait = max(startup_timeout, STARTUP_MIN_S)
            await session._setup([], wait, "starting the session")
            match = await session._setup(sources, wait, "sourcing the startup files")
        except BaseException:
            await session.close()
            raise
        return session, match.output

    async def _setup(self, sources: list[str], timeout: float, doing: str) -> Match:
        self.nonce = new_nonce()
        return await self._line(setup_line(self.nonce, sources), [], timeout, doing)

    async def _read(self) -> None:
        try:
            async for event in self.edge.attach(self.sandbox_id, self.process):
                if isinstance(event, Output):
                    self.transcript.feed(event.data)
                    self._changed.set()
        except DSecError:
            pass
        finally:
            self.ended = True
            self._changed.set()

    async def _send(self, data: bytes) -> None:
        if self.ended:
            raise SwerexError("SessionNotInitializedError", "the session's shell has exited")
        await self.edge.send_stdin(self.sandbox_id, self.process, data)

    async def _wait(self, expect: list[str], timeout: float) -> Match | None:
        """The prompt of the current nonce or an expect string, within ``timeout``."""
        deadline = time.monotonic() + timeout
        self.transcript.watch(self.nonce, expect)
        while True:
            self._changed.clear()
            match = self.transcript.match
            if match is not None:
                self.transcript, after = Transcript(), bytes(self.transcript.after)
                self.transcript.feed(after)
                return match
            left = deadline - time.monotonic()
            if self.ended or left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def _line(self, line: bytes, expect: list[str], timeout: float, doing: str) -> Match:
        await self._send(line)
        match = await self._wait(expect, timeout)
        if match is None:
            raise self._timeout(timeout, doing)
        return match

    def _timeout(self, timeout: float, doing: str) -> SwerexError:
        if self.ended:
            return SwerexError("SessionNotInitializedError", "the session's shell has exited")
        return SwerexError("CommandTimeoutError", f"timeout after {timeout} seconds while {doing}")

    async def run(self, action: BashAction | BashInterruptAction) -> dict[str, object]:
        async with self.lock:
            if isinstance(action, BashInterruptAction):
                return await self._interrupt(action)
            timeout = DEFAULT_TIMEOUT_S if action.timeout is None else action.timeout
            doing = f"running command {action.command!r}"
            if action.is_interactive_command or action.is_interactive_quit:
                match = await self._line(action.command.encode() + b"\n", action.expect, timeout, doing)
                output = match.output
                if action.is_interactive_command:  # as SWE-ReX trims it (and any echo of the line)
                    output = output.lstrip().removeprefix(action.command).strip()
                return observation(output, 0, match.expect_string)
            self.nonce = new_nonce()
            match = await self._line(command_line(action.command, self.nonce), action.expect,
                                     timeout, doing)
        if match.syntax_error:
            raise SwerexError("BashIncorrectSyntaxError", (
                f"Error (exit code 2) while checking bash command \n{action.command!r}\n"
                f"---- Stderr ----\n{match.output}\n---- Stdout ----\n"),
                {"bash_stdout": "", "bash_stderr": match.output})
        if action.check == "ignore":
            return observation(match.output, None, match.expect_string)
        if match.exit_code is None and action.check == "raise":
            raise SwerexError("NoExitCodeError", f"an expect string ({match.expect_string!r}) "
                              "matched before the command's exit code was known")
        if action.check == "raise" and match.exit_code != 0:
            message = (f"Command {action.command!r} failed with exit code {match.exit_code}. "
                       f"Here is the output:\n{match.output!r}")
            raise SwerexError("NonZeroExitCodeError",
                              f"{action.error_msg}: {message}" if action.error_msg else message)
        return observation(match.output, match.exit_code, match.expect_string)

    async def _interrupt(self, action: BashInterruptAction) -> dict[str, object]:
        for _ in range(action.n_retry):
            await self._send(b"\x03")
            match = await self._wait(action.expect, max(action.timeout, INTERRUPT_WAIT_S))
            if match is not None:
                return observation(match.output.strip(), 0, match.expect_string)
        await self._send(b"\x1a")  # Ctrl-Z, then kill the stopped job
        await self._wait(action.expect, max(action.timeout, INTERRUPT_WAIT_S))
        wait = max(action.timeout, 1.0)
        match = await self._line(b"kill -9 %1\n", action.expect, wait, "interrupting the session")
        # one more prompt, so bash's "Killed" notice is this answer's, not the next command's
        self.nonce = new_nonce()
        notice = await self._line(command_line("true", self.nonce), [], wait, "interrupting the session")
        return observation((match.output + notice.output).strip(), 0, match.expect_string)

    async def close(self) -> None:
        if not self.ended:
            with contextlib.suppress(DSecError):
                await self.edge.signal(self.sandbox_id, self.process, signal.SIGKILL)
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, DSecError):
            await self._reader
