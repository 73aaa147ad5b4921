"""Builds an ImageSpec into layers: one immutable, content-addressed layer per spec section.

The base layer is an mmdebstrap root; the toolkit and workspace layers run their steps in a
chroot over an overlay of the layers below, and the overlay's upper directory (whiteouts and
opaque directories included) becomes the layer. Every step runs in fresh mount and PID
namespaces, so its mounts and leftover processes (daemons started by a package) go away with
it, whether it succeeds, fails or is killed.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shlex
import subprocess
import tarfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from dsec.images.mount import overlay_options
from dsec.images.spec import WORKDIR, ImageSpec, ToolkitSection, WorkspaceSection
from dsec.protocol.errors import ImageBuildError

if TYPE_CHECKING:
    from rich.console import Console

    from dsec.images.store import Layer, LayerStore

log = logging.getLogger(__name__)

# Bump to invalidate every cached layer when the way layers are built changes.
_KEY_VERSION = "dsec-layer-v1"
_BUILD_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LC_ALL": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}
_HOST_RESOLV_CONF = Path("/etc/resolv.conf")
_HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
_BUILD_CA_BUNDLE = "/run/dsec-build/ca-certificates.crt"
_APT_INSTALL = """apt-get update -q
apt-get install -y -q --no-install-recommends "$@"
apt-get clean
rm -rf /var/lib/apt/lists/*"""


@dataclass(frozen=True)
class LayerPlan:
    section: str  # "base" | "toolkit" | "workspace"
    digest: str  # the cache key: parent digest + canonical JSON of the section
    content: dict[str, Any]


@dataclass(frozen=True)
class _Step:
    title: str
    argv: tuple[str, ...]  # run inside the chroot
    stdin: bytes = b""


def layer_key(parent: str | None, content: dict[str, Any]) -> str:
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(f"{_KEY_VERSION}\n{parent or ''}\n{canonical}".encode()).hexdigest()


def plan_layers(spec: ImageSpec) -> list[LayerPlan]:
    """The layers ``spec`` needs, bottom→top, with their cache keys (no I/O).

    An empty toolkit section makes no layer: it would only add a mount to every sandbox.
    """
    sections = [("base", spec.base.to_dict())]
    if not spec.toolkit.empty:
        sections.append(("toolkit", spec.toolkit.to_dict()))
    sections.append(("workspace", spec.workspace.to_dict()))
    plans: list[LayerPlan] = []
    for section, content in sections:
        content = {"section": section, **content}
        plans.append(LayerPlan(section, layer_key(plans[-1].digest if plans else None, content), content))
    return plans


def build_layers(spec: ImageSpec, store: LayerStore, console: Console | None = None) -> list[Layer]:
    """Build every layer of ``spec`` missing from ``store``, reusing the cached ones."""
    progress = BuildProgress(console)
    layers: list[Layer] = []
    for plan in plan_layers(spec):
        label = f"{spec.name}/{plan.section}"
        build = (
            _base_build(spec)
            if plan.section == "base"
            else _overlay_build(list(layers), _steps(spec, plan.section))
        )
        started = time.monotonic()
        with progress.layer(label) as report:
            layer, fresh = store.ensure(plan.digest, plan.content, partial(build, report))
        progress.finished(label, layer, time.monotonic() - started if fresh else None)
        layers.append(layer)
    return layers


def _steps(spec: ImageSpec, section: str) -> list[_Step]:
    return _toolkit_steps(spec.toolkit) if section == "toolkit" else _workspace_steps(spec.workspace)


def _toolkit_steps(toolkit: ToolkitSection) -> list[_Step]:
    steps = []
    if toolkit.packages:
        title = f"apt-get install {' '.join(toolkit.packages)}"
        steps.append(_Step(title, ("/bin/sh", "-euc", _APT_INSTALL, "sh", *toolkit.packages)))
    if toolkit.pip:
        pip = (
            "python3",
            "-m",
            "pip",
            "install",
            "--no-cache-dir",
            "--break-system-packages",
            "--root-user-action=ignore",
        )
        steps.append(_Step(f"pip install {' '.join(toolkit.pip)}", (*pip, *toolkit.pip)))
    return steps


def _workspace_steps(workspace: WorkspaceSection) -> list[_Step]:
    """Files (and ``/work``, which every image has) arrive as a tar extracted inside the chroot,
    so symlinks in the image resolve within it."""
    files = _Step(
        "write /work and files", ("tar", "-x", "-p", "-C", "/", "-f", "-"), _files_tar(workspace.files)
    )
    commands = [
        _Step(f"$ {cmd}", ("/bin/sh", "-c", f"cd {WORKDIR} || exit\n{cmd}")) for cmd in workspace.commands
    ]
    return [files, *commands]


def _files_tar(files: tuple[tuple[str, str], ...]) -> bytes:
    buffer, now = io.BytesIO(), time.time()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        workdir = tarfile.TarInfo(WORKDIR.lstrip("/"))
        workdir.type, workdir.mode, workdir.mtime = tarfile.DIRTYPE, 0o755, now
        tar.addfile(workdir)
        for path, content in files:
            data = content.encode()
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), 0o644, now
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _base_build(spec: ImageSpec) -> Callable[[Callable[[str], None], Path], None]:
    def build(report: Callable[[str], None], scratch: Path) -> None:
        argv = ["mmdebstrap", f"--variant={spec.base.variant}", "--mode=root", "--format=directory"]
        title = f"mmdebstrap {spec.base.suite} ({spec.base.variant})"
        _run(title, _isolated([*argv, spec.base.suite, str(scratch / "rootfs")]), report, os.environ.copy())

    return build


def _overlay_build(parents: list[Layer], steps: list[_Step]) -> Callable[[Callable[[str], None], Path], None]:
    def build(report: Callable[[str], None], scratch: Path) -> None:
        upper, work, merged = scratch / "rootfs", scratch / "work", scratch / "merged"
        for d in (upper, work, merged):
            d.mkdir()
        env_dir, env = _build_env(scratch / "env")
        mounts, lowers = [], [env_dir]
        for index, layer in enumerate(reversed(parents)):  # overlay wants the top layer first
            if layer.format == "erofs":
                target = scratch / "lower" / str(index)
                target.mkdir(parents=True)
                mounts.append(
                    f"mount -t erofs -o ro,loop {shlex.quote(str(layer.path))} {shlex.quote(str(target))}"
                )
                lowers.append(target)
            else:
                lowers.append(layer.path)
        root = shlex.quote(str(merged))
        script = "\n".join(
            (
                *mounts,
                f"mount -t overlay overlay -o {shlex.quote(overlay_options(lowers, upper, work))} {root}",
                f"mount -t proc proc {root}/proc",
                f"mount -t sysfs -o ro sysfs {root}/sys",
                f'exec chroot {root} "$@"',
            )
        )
        for step in steps:
            report(step.title)
            _run(
                step.title, _isolated(["/bin/sh", "-euc", script, "sh", *step.argv]), report, env, step.stdin
            )

    return build


def _build_env(env_dir: Path) -> tuple[Path, dict[str, str]]:
    """A top overlay layer seen only while building: the host's DNS and CA bundle (so apt and
    pip work behind the host's resolver and TLS proxy) and a policy-rc.d that keeps package
    scripts from starting services. Nothing in it lands in the layer unless a step changes it."""
    env = dict(_BUILD_ENV)
    files = {"usr/sbin/policy-rc.d": (b"#!/bin/sh\nexit 101\n", 0o755)}
    if _HOST_RESOLV_CONF.exists():
        files["etc/resolv.conf"] = (_HOST_RESOLV_CONF.read_bytes(), 0o644)
    if _HOST_CA_BUNDLE.exists():
        files[_BUILD_CA_BUNDLE.lstrip("/")] = (_HOST_CA_BUNDLE.read_bytes(), 0o644)
        env |= {
            name: _BUILD_CA_BUNDLE
            for name in ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
        }
    for relative, (data, mode) in files.items():
        path = env_dir / relative
        for directory in reversed(path.relative_to(env_dir).parents):
            (env_dir / directory).mkdir(mode=0o755, exist_ok=True)
            os.chmod(env_dir / directory, 0o755)  # it shadows the image's directory attributes
        path.write_bytes(data)
        os.chmod(path, mode)
    return env_dir, env


def _isolated(argv: list[str]) -> list[str]:
    """Run ``argv`` in fresh mount and PID namespaces: when it ends, its mounts and processes go too."""
    return ["unshare", "--mount", "--propagation=private", "--pid", "--fork", "--kill-child", "--", *argv]


def _run(
    title: str, argv: list[str], report: Callable[[str], None], env: dict[str, str], stdin: bytes = b""
) -> None:
    """Run a build command, passing each output line to ``report`` and keeping the tail for errors."""
    tail: deque[str] = deque(maxlen=25)
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(stdin)  # small (workspace files); the commands read it before writing much
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it exited without reading its input: its exit status and output say why
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line:
                tail.append(line)
                report(line)
        returncode = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: --kill-child takes the namespace down with it
            proc.kill()
            proc.wait()
    if returncode != 0:
        raise ImageBuildError(f"{title!r} failed (exit {returncode}):\n" + "\n".join(tail), step=title)


def _log_line(label: str, line: str) -> None:
    log.debug("%s: %s", label, line)


def _show_line(progress: Progress, task: TaskID, line: str) -> None:
    progress.update(task, line=line[:80])


class BuildProgress:
    """Per-layer progress: a live rich line (spinner, elapsed time, latest output line) on a
    terminal console, one summary line per layer on other consoles, log records without one."""

    def __init__(self, console: Console | None) -> None:
        self._console = console

    @contextmanager
    def layer(self, label: str) -> Iterator[Callable[[str], None]]:
        with self.layers([label]) as (report,):
            yield report

    @contextmanager
    def layers(self, labels: list[str]) -> Iterator[list[Callable[[str], None]]]:
        """A live line per label at once (layers built in parallel); updaters are thread-safe."""
        if self._console is None or not self._console.is_terminal:
            yield [partial(_log_line, label) for label in labels]
            return
        columns = (
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[line]}", style="dim", markup=False),  # raw apt/pip output
        )
        with Progress(*columns, console=self._console, transient=True) as progress:
            tasks = [progress.add_task(label, line="") for label in labels]
            yield [partial(_show_line, progress, task) for task in tasks]

    def finished(self, label: str, layer: Layer, seconds: float | None) -> None:
        """``seconds`` is None for a cache hit."""
        size = f"{layer.size_bytes / 1e6:.1f} MB {layer.format}"
        if seconds is None:
            message = f"{label}: cached {layer.digest[:19]} ({size})"
        else:
            message = f"{label}: built {layer.digest[:19]} in {seconds:.1f} s ({size})"
        if self._console is None:
            log.info(message)
        else:
            self._console.print(
                ("[green]✓[/] " if seconds is not None else "[dim]=[/] ") + message, highlight=False
            )
