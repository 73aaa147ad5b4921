"""The wire of a SWE-ReX bash session over a terminal, as pure functions: what dsec types into
the session's bash and how it reads the answer back out of the terminal's output.

SWE-ReX's own server drives an interactive bash with pexpect and waits for a fixed ``PS1``;
the exit code then comes from a second ``echo $?``. dsec does it in one line per command:

    PS1='@@<nonce>:$?:<nonce>@@'; if "$BASH" -n -c $'<cmd>'; then eval $'<cmd>';
    PS1='@@<nonce>:'$?':<nonce>@@'; else PS1='@@<nonce>:syntax:<nonce>@@'; fi

with the command byte-escaped: one line whatever it holds (newlines, heredocs, quotes), so a
syntax error or an unclosed heredoc is reported (``BashIncorrectSyntaxError``, nothing run),
never a session waiting for more input.
When the command ends, bash prints the prompt: ``@@<nonce>:<exit code>:<nonce>@@``, with a
fresh random nonce per command. The typed line never contains that text (it holds ``$?``,
not digits), and a program in the sandbox cannot print it before the command is sent
because the nonce does not exist yet: a test suite that prints SWE-ReX's ``EXITCODESTART0``
or an earlier prompt does not end the command early or fake its exit code.

Everything read here is the sandbox's output, so hostile: a command's output is kept to
``OUTPUT_CAP`` bytes (its head, then its newest ``TAIL`` bytes, where the prompt appears) and
decoded with replacement. The bash is the image's, so a session's exit codes are as
trustworthy as the image's bash; a reward check should use ``/execute`` (dsec's agent reports
its exit code out of band).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

OUTPUT_CAP = 1 << 20  # bytes of one command's output kept (head)
TAIL = 64 << 10  # the newest bytes kept after the head: where the prompt and expect strings are
PS1_NAME = "SHELLPS1PREFIX"  # what SWE-ReX reports as the matched expect string for its prompt
SYNTAX = "syntax"  # the prompt's status when the command did not parse (and so did not run)

_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-./,:=+@%")


def new_nonce() -> str:
    return secrets.token_hex(16)


def prompt(nonce: str) -> str:
    """The PS1 value (single-quoted): ``$?`` expands when bash prints it."""
    return f"'@@{nonce}:$?:{nonce}@@'"


def prompt_pattern(nonce: str) -> re.Pattern[bytes]:
    status = rb"(?P<code>\d{1,3}|" + SYNTAX.encode() + rb")"
    return re.compile(rb"@@" + nonce.encode() + rb":" + status + rb":" + nonce.encode() + rb"@@")


def ansi_c_quote(text: str) -> str:
    """``text`` as a bash ``$'...'`` word on one line: every byte but a few safe ones escaped."""
    return "$'" + "".join(chr(b) if b in _SAFE else f"\\x{b:02x}" for b in text.encode()) + "'"


def command_line(command: str, nonce: str) -> bytes:
    """The line that checks ``command``'s syntax (``bash -n`` of the session's own bash, as
    SWE-ReX does before running anything), runs it if it parses, and then prints ``nonce``'s
    prompt with its exit code, or ``syntax`` in its place. PS1 is set before (so a line cut
    short by Ctrl-C still ends in this nonce's prompt) and again after, with the status
    expanded then (so a command that sets its own PS1, e.g. sourcing a profile, does not hide
    the prompt). The line itself never holds a prompt's text (quotes split each one), should
    the terminal echo it. A leading space keeps the line out of bash's history."""
    quoted = ansi_c_quote(command)
    after = f"'@@{nonce}:'$?':{nonce}@@'"
    return (f' PS1={prompt(nonce)}; if "${{BASH:-bash}}" -n -c {quoted}; then eval {quoted}; '
            f"PS1={after}; else PS1='@@{nonce}:'{SYNTAX}':{nonce}@@'; fi\n").encode()


def setup_line(nonce: str, sources: list[str]) -> bytes:
    """The session's first lines: no terminal echo, no bracketed paste, empty PS2/PS0, the
    requested files sourced (they often set PS1), then the prompt."""
    parts = ["stty -echo 2>/dev/null", "bind 'set enable-bracketed-paste off' 2>/dev/null",
             "export PS2='' PS0='' PROMPT_COMMAND=''"]
    parts += [f"source {ansi_c_quote(path)}" for path in sources]
    return f" {'; '.join(parts)}; PS1={prompt(nonce)}\n".encode()


def clean(raw: bytes) -> str:
    """Terminal output as SWE-ReX returns it: escape sequences removed, ``\\r\\n`` as
    ``\\n``, the newline bash's line editor prints when a line is accepted dropped."""
    text = _ANSI.sub("", raw.decode(errors="replace")).replace("\r\n", "\n")
    return re.sub(r"^\r*\n", "", text, count=1)


@dataclass
class Match:
    output: str
    expect_string: str
    exit_code: int | None  # the prompt's, or None when an expect string matched
    syntax_error: bool = False  # the command did not parse and was not run


@dataclass
class Transcript:
    """One command's output as it arrives: the first ``cap`` bytes and the newest ``tail``
    bytes, with a count of what was dropped between them. ``watch`` names what ends the
    command (the prompt of a nonce, expect strings); each chunk is searched once as it comes
    (with the end of the one before, for a match across chunks), so a flood costs its length,
    not its length times the output kept. What follows a match is kept in ``after`` (at most
    ``tail`` bytes) for the next command, as a terminal would leave it."""

    cap: int = OUTPUT_CAP
    tail: int = TAIL
    head: bytearray = field(default_factory=bytearray)
    newest: bytearray = field(default_factory=bytearray)
    dropped: int = 0
    match: Match | None = None
    after: bytearray = field(default_factory=bytearray)
    _pattern: re.Pattern[bytes] | None = None
    _expect: dict[str, str] = field(default_factory=dict)  # group name -> expect string
    _longest: int = 1
    _carry: bytes = b""

    @property
    def total(self) -> int:
        return len(self.head) + self.dropped + len(self.newest)

    def watch(self, nonce: str | None, expect: list[str]) -> Match | None:
        """Look for the prompt of ``nonce`` and the ``expect`` strings (at most ``tail`` bytes
        each), in what came so far and from now on; the first in the output wins."""
        alternatives = []
        if nonce is not None:
            alternatives.append(b"(?P<prompt>" + prompt_pattern(nonce).pattern + b")")
        self._expect = {}
        for i, wanted in enumerate(w for w in expect if w and len(w.encode()) <= self.tail):
            self._expect[f"e{i}"] = wanted
            alternatives.append(f"(?P<e{i}>".encode() + re.escape(wanted.encode()) + b")")
        self._pattern = re.compile(b"|".join(alternatives)) if alternatives else None
        self._longest = max([len(w.encode()) for w in self._expect.values()] + [80 if nonce else 1])
        self.match, self._carry = None, b""
        if self.dropped:  # what is kept of the output so far, searched once
            self._search(bytes(self.head), 0)
            if self.match is None:
                self._carry = b""
                self._search(bytes(self.newest), self.total - len(self.newest))
        else:
            self._search(bytes(self.head) + bytes(self.newest), 0)
        return self.match

    def feed(self, data: bytes) -> None:
        if self.match is not None:
            self.after += data
            del self.after[:max(0, len(self.after) - self.tail)]
            return
        start = self.total
        room = self.cap - len(self.head)
        if room > 0 and not self.dropped and not self.newest:
            self.head += data[:room]
            self.newest += data[room:]
        else:
            self.newest += data
        excess = len(self.newest) - self.tail
        if excess > 0:
            del self.newest[:excess]
            self.dropped += excess
        self._search(data, start)

    def _search(self, data: bytes, offset: int) -> None:
        """Search ``data`` (stream offset ``offset``) after the carried end of what came before."""
        if self._pattern is None:
            return
        window = self._carry + data
        m = self._pattern.search(window)
        if m is None:
            self._carry = window[-(self._longest - 1):] if self._longest > 1 else b""
            return
        start = offset - len(self._carry) + m.start()
        group = m.lastgroup or ""
        if group == "prompt":
            status = m.group("code")
            matched, code = PS1_NAME, None if status == SYNTAX.encode() else int(status)
        else:
            matched, code, status = self._expect[group], None, b""
        self.match = Match(clean(self._before(start)), matched, code, status == SYNTAX.encode())
        self.after = bytearray(window[m.end():][-self.tail:])

    def _before(self, start: int) -> bytes:
        """The output kept before stream offset ``start``."""
        if start <= len(self.head):
            return bytes(self.head[:start])
        first_newest = self.total - len(self.newest)
        note = f"\n[... {self.dropped} bytes of output dropped ...]\n".encode() if self.dropped else b""
        return bytes(self.head) + note + bytes(self.newest[:max(0, start - first_newest)])
