"""The web dashboard, rendered by headless Chromium against a running dsec with sandboxes."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path
from typing import Iterator

import pytest

import dsec
from conftest import Server, make_tcp_server, stop_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package "
                                "(apt-get install chromium) for the headless render")


def chromium(*args: str) -> str:
    """Run headless Chromium; what it prints (the DOM, with --dump-dom)."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                               f"--user-data-dir={profile}", "--virtual-time-budget=10000",
                               *args], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def text_of(dom: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    assert found, f"#{element_id} is not in the page"
    return found.group(1)


def png_rows(path: Path) -> list[bytes]:
    """The decoded pixel rows of an 8-bit RGB/RGBA PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and color in (2, 6), (depth, color)
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up, corner = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append(bytes(line))
        prev = line
    return rows


@pytest.fixture(scope="module")
def srv(images) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    server = make_tcp_server("--warm-pool", "0").start()
    yield server
    stop_server(server)


async def test_dashboard_renders_live_numbers_for_a_valid_key_only(srv: Server) -> None:
    async with srv.client() as admin:
        await admin.projects().create("dash-team", sandboxes=1, cpu=2, memory_mb=1024)
        team_key = (await admin.projects().create_key("dash-team", "viewer")).key
        mine = [await admin.create(memory_mb=128) for _ in range(2)]
        async with dsec.DSecClient(srv.url, team_key, autostart=False) as team:
            theirs = await team.create(memory_mb=128)
            with pytest.raises(dsec.QuotaExceeded):
                await team.create(memory_mb=128)
        try:
            page = f"{srv.url}/dashboard"
            dom = chromium("--dump-dom", f"{page}#key={srv.key}")
            assert text_of(dom, "live-total") == "3"
            assert text_of(dom, "scope") == "admin view"
            assert 'data-project="dash-team"' in dom and "<td>1 / 1</td>" in dom
            assert "<td>quota_exceeded</td>" in dom
            assert text_of(dom, "latency-count") == "3"  # three creates went through
            assert re.search(r'<main id="data">', dom), "the data is shown"

            dom = chromium("--dump-dom", f"{page}#key={team_key}")  # a project's view
            assert text_of(dom, "live-total") == "1"
            assert text_of(dom, "scope") == "project dash-team"
            assert 'data-project="default"' not in dom

            for url, message in ((page, ""), (f"{page}#key=dsk_not-a-key", "That key is not valid.")):
                dom = chromium("--dump-dom", url)
                assert re.search(r'<main id="data" hidden', dom), "no data without a valid key"
                assert text_of(dom, "live-total") == "0" and "dash-team" not in dom
                assert text_of(dom, "login-error") == message

            with tempfile.TemporaryDirectory() as shots:
                shot = Path(shots) / "dashboard.png"
                chromium(f"--screenshot={shot}", "--window-size=1280,900",
                         f"{page}#key={srv.key}")
                rows = png_rows(shot)
            assert len(rows) == 900
            values = [b for row in rows[::7] for b in row[::5]]
            mean = sum(values) / len(values)
            variance = sum((v - mean) ** 2 for v in values) / len(values)
            assert variance > 100, f"the screenshot looks blank (variance {variance:.1f})"
            assert len(set(rows)) > 50, "too few distinct rows for a rendered page"
        finally:
            for sb in [*mine, await admin.get(theirs.id)]:  # the admin may stop any
                await sb.stop()
