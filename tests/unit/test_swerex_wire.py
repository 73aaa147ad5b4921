"""The pure parts of the SWE-ReX front-end: the session's line protocol (quoting, prompts that
output cannot forge, capped transcripts), zip uploads re-packed as safe tars, the shared
multipart parser, and the fixed exception classes a 511 may name."""

from __future__ import annotations

import io
import subprocess
import tarfile
import zipfile

import pytest

from dsec.compat.multipart import form_parts
from dsec.compat.swerex_models import SwerexError
from dsec.compat.swerex_shell import (
    PS1_NAME,
    Transcript,
    ansi_c_quote,
    clean,
    command_line,
    new_nonce,
)
from dsec.compat.zipped import safe_name, zip_to_tar
from dsec.protocol.errors import UnsafeArchive

NASTY = "echo 'a' \"b\" $HOME `id` \\ \n\ttab; cat <<EOF\nx\nEOF\n\x01 é ☃ $'q'"


def test_ansi_c_quote_round_trips_through_bash() -> None:
    quoted = ansi_c_quote(NASTY)
    assert "\n" not in quoted and "'" not in quoted[2:-1]
    out = subprocess.run(["bash", "-c", f"printf %s {quoted}"], capture_output=True, check=True)
    assert out.stdout == NASTY.encode()


def test_command_line_is_one_line_and_holds_no_prompt() -> None:
    nonce = new_nonce()
    line = command_line(NASTY, nonce)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    t = Transcript()
    t.watch(nonce, [])
    t.feed(line)  # an echoed command line is not its prompt
    assert t.match is None


def test_a_syntax_error_is_its_own_status() -> None:
    nonce = new_nonce()
    t = Transcript()
    t.watch(nonce, [])
    t.feed(f"bash: -c: syntax error\r\n@@{nonce}:syntax:{nonce}@@".encode())
    assert t.match is not None and t.match.syntax_error and t.match.exit_code is None
    assert t.match.output == "bash: -c: syntax error\n"


def test_prompt_ends_the_command_with_its_exit_code() -> None:
    nonce = new_nonce()
    t = Transcript()
    t.watch(nonce, [])
    for chunk in (b"\x1b[?2004l\r\r\nhello\r\n@@" + nonce[:5].encode(), nonce[5:].encode() + b":42:",
                  nonce.encode() + b"@@", b"next"):
        t.feed(chunk)
    match = t.match
    assert bytes(t.after) == b"next"
    assert match is not None and (match.output, match.exit_code, match.expect_string) == \
        ("hello\n", 42, PS1_NAME)


def test_other_nonces_and_swerex_markers_are_plain_output() -> None:
    nonce, other = new_nonce(), new_nonce()
    t = Transcript()
    t.feed(f"@@{other}:0:{other}@@ EXITCODESTART0EXITCODEEND SHELLPS1PREFIX".encode())
    assert t.watch(nonce, []) is None
    t.feed(f"@@{nonce}:3:{nonce}@@".encode())
    match = t.match
    assert match is not None and match.exit_code == 3 and "EXITCODESTART0" in match.output


def test_expect_strings_and_the_first_match_wins() -> None:
    nonce = new_nonce()
    t = Transcript()
    t.feed(f"Python 3\n>>> later @@{nonce}:0:{nonce}@@".encode())
    match = t.watch(nonce, [">>> "])
    assert match is not None and (match.output, match.expect_string, match.exit_code) == \
        ("Python 3\n", ">>> ", None)


def test_a_flood_keeps_head_and_tail_and_still_finds_the_prompt() -> None:
    nonce = new_nonce()
    t = Transcript(cap=100, tail=120)
    t.watch(nonce, [])
    for _ in range(1000):
        t.feed(b"a" * 1000)
    t.feed(b"END" + f"@@{nonce}:".encode())
    t.feed(f"0:{nonce}@@".encode())
    assert len(t.head) == 100 and len(t.newest) <= 120 and t.dropped > 990_000
    match = t.match
    assert match is not None and match.exit_code == 0
    assert match.output.startswith("a" * 100) and "bytes of output dropped" in match.output
    assert match.output.endswith("END") and len(match.output) < 300


def test_watching_after_a_flood_searches_what_was_kept() -> None:
    nonce = new_nonce()
    t = Transcript(cap=10, tail=200)
    t.feed(b"b" * 5000 + f"@@{nonce}:5:{nonce}@@tail".encode())
    match = t.watch(nonce, ["nowhere"])
    assert match is not None and match.exit_code == 5
    assert match.output.startswith("b" * 10) and "bytes of output dropped" in match.output
    assert bytes(t.after) == b"tail"


def test_clean_strips_terminal_escapes() -> None:
    assert clean(b"\x1b[?2004l\r\r\n\x1b[31mred\x1b[0m\r\n\x1b]0;title\x07x") == "red\nx"


def _zip(members: list[tuple[zipfile.ZipInfo | str, bytes]]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info, data in members:
            z.writestr(info, data)
    return out.getvalue()


def test_zip_members_stay_under_the_target_as_files_and_directories() -> None:
    link = zipfile.ZipInfo("link")
    link.external_attr = 0o120777 << 16
    exe = zipfile.ZipInfo("bin/run")
    exe.external_attr = 0o100755 << 16
    data = _zip([("../up.txt", b"u"), ("/abs/a.txt", b"a"), ("x/../../../y.txt", b"y"),
                 ("C:/drive.txt", b"d"), (link, b"/etc"), (exe, b"#!"), ("dir/", b""),
                 ("..", b"nothing")])
    with tarfile.open(fileobj=io.BytesIO(zip_to_tar(data))) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert sorted(members) == ["abs/a.txt", "bin/run", "dir", "drive.txt", "link", "up.txt",
                                   "x/y.txt"]
        assert all(m.isfile() or m.isdir() for m in members.values())
        assert members["dir"].isdir() and members["bin/run"].mode == 0o755
        assert members["link"].isfile() and tar.extractfile("link").read() == b"/etc"  # type: ignore[union-attr]


def test_safe_name() -> None:
    assert safe_name("/a/./b/../c") == "a/b/c"
    assert safe_name("..\\..\\win.txt") == "win.txt"
    assert safe_name("../..") == ""


def test_zip_bombs_and_garbage_are_refused() -> None:
    with pytest.raises(UnsafeArchive):
        zip_to_tar(_zip([("big", b"\0" * 1000)]), max_unpacked=999)
    with pytest.raises(UnsafeArchive):
        zip_to_tar(b"PK\x03\x04not a zip")


def test_multipart_fields_and_files() -> None:
    body = (b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"z.zip\"\r\n"
            b"Content-Type: application/zip\r\n\r\n\x00\r\n--x\r\n--B\r\n"
            b"Content-Disposition: form-data; name=\"target_path\"\r\n\r\n/tmp/t\r\n--B--\r\n")
    parts = form_parts("multipart/form-data; boundary=B", body)
    assert [(p.name, p.filename, p.content) for p in parts] == [
        ("file", "z.zip", b"\x00\r\n--x"), ("target_path", None, b"/tmp/t")]
    with pytest.raises(ValueError):
        form_parts("multipart/form-data", body)


def test_511_names_only_fixed_classes() -> None:
    assert SwerexError("NonZeroExitCodeError", "m").body() == {"swerexception": {
        "message": "m", "class_path": "swerex.exceptions.NonZeroExitCodeError", "traceback": "",
        "extra_info": {}}}
    assert SwerexError("builtins.FileNotFoundError", "m").class_path == "builtins.FileNotFoundError"
    for bad in ("os.system", "builtins.eval", "subprocess.getoutput", "swerex.exceptions.x"):
        with pytest.raises(AssertionError):
            SwerexError(bad, "touch /tmp/x")
