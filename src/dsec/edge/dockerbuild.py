"""Dockerfile builds: every step that changes files runs in a real dsec container sandbox.

A RUN is hostile code (install scripts of arbitrary packages), so it runs where every other
untrusted command runs: a container sandbox of the image so far, with its limits, seccomp,
no new privileges, dropped capabilities, a bounded disk, and no network unless the build is
given an egress policy (the edge's service table, as for sandboxes). When it exits 0, its
processes are frozen and its overlay upper directory (its changes, with overlay whiteouts)
is copied by ``images/upper.py`` into a new content-addressed layer (``Edge.commit_layer``,
data in and out, so the driver needs nothing of the edge but its operations); the sandbox is
removed.
COPY/ADD take a tar of context files (checked by ``images/build_context.py``) and extract it
with dsec's own tar in such a sandbox, so destinations resolve in the image's own root as in
Docker; WORKDIR makes its directory the same way. ENV, USER, LABEL, ARG, ENTRYPOINT, CMD
only change the image config.

Buildah (in Debian) was the alternative: it would run RUN steps with its own isolation, not
dsec's, and its egress could not be the sandboxes' policy; measured, a dsec container
starts in well under a second, so a sandbox per step costs little next to the step itself.

Cache: a layer's digest is its cache key, ``layer_key(parent image digest, instruction text
+ the env, workdir, user and ARG values it ran with + the COPY tar's digest + a RUN's egress
policy, unless none)``; a key whose layer is stored is a hit and runs nothing. The store is
shared by every project, so a key holds everything a RUN's result can depend on that its
builder chose. Intermediate layers belong to no name once the
build is over: the image GC collects those nothing uses (images/gc.py).

Two callers: the command line's builder edge (a context directory on this host), and the
server's ``build_image`` operation (``build_events``: a context tar uploaded by the client,
extracted with the SDK's checked extractor (protocol/archive.py) into a scratch directory,
then the same build, its progress streamed as ``BuildLog`` lines with RUN output capped).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import posixpath
import secrets
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text

from ..agent.client import Output
from ..agent.tools import TAR
from ..images.build_context import context_copy
from ..images.builder import layer_key
from ..images.dockerfile import Instruction, base_image, pairs, parse, sources_and_dest
from ..images.store import Image, ImageConfig, Layer, image_digest
from ..protocol import archive
from ..protocol.build import BuildLog, ImageBuildRequest, ImageBuilt
from ..protocol.errors import DSecError, ImageBuildError, ImageNotFound, InvalidRequest
from ..protocol.models import CreateRequest, ExecRequest, ExecResult, Network

if TYPE_CHECKING:
    from .edge import Edge

TAIL_BYTES = 4096  # of a failing step's output, in its error
# The image a build's steps run on (its COPYs, secrets included, and RUNs so far), named in
# a project namespace no project has: a project's name never starts with '_', and a
# project's key is refused every other project's 'p.NAME.' (control/image_names.py), so no
# other project creates a sandbox of a build under way, even knowing the name.
SCRATCH_PREFIX = "p._build.dsec-build-"
MAX_LOG_BYTES = 1 << 20  # of RUN output streamed by one server build; the rest is dropped
OUTPUT_MARK = "  │ "  # starts a line of a step's output in the build's log
_CLEANING: set[asyncio.Task[Any]] = set()  # cancelled builds finishing their clean-up


@dataclass
class StepReport:
    line: int
    instruction: str
    cached: bool
    layer: str | None = None


@dataclass
class DockerfileBuild:
    image: Image
    steps: list[StepReport] = field(default_factory=list)

    @property
    def cached(self) -> int:
        return sum(1 for s in self.steps if s.layer and s.cached)

    @property
    def ran(self) -> int:
        return sum(1 for s in self.steps if s.layer and not s.cached)


@dataclass
class BuildOptions:
    network: Network = "none"
    build_args: dict[str, str] = field(default_factory=dict)
    disk_mb: int = 4096
    memory_mb: int = 2048
    cpu: float = 1.0
    step_timeout_s: float = 3600.0


class _Build:
    def __init__(self, edge: Edge, context: Path, name: str, options: BuildOptions,
                 say: Callable[[str], None]) -> None:
        self.edge, self.context, self.name, self.options, self.say = edge, context, name, options, say
        self.layers: list[Layer] = []
        self.config = ImageConfig()
        self.args: dict[str, str] = {}
        self.scratch_name = f"{SCRATCH_PREFIX}{secrets.token_hex(6)}"  # the image steps run on

    async def parent(self, ref: str) -> None:
        images = self.edge.images
        try:
            image = await asyncio.to_thread(images.ensure, ref)
        except ImageNotFound:
            if not images.pullable(ref):
                raise
            image = await asyncio.to_thread(images.pull, ref, missing_only=True)
        self.layers = list(image.layers)
        self.config = image.config

    def key(self, instruction: Instruction, extra: dict[str, Any]) -> str:
        return layer_key(image_digest(self.layers), {
            "dockerfile": instruction.text, "env": list(self.config.env),
            "workdir": self.config.working_dir, "user": self.config.user,
            "args": sorted(self.args.items()), **extra})

    def network(self, instruction: Instruction) -> Network:
        """A step's egress: the build's for a RUN, unless it says ``--network=none``; none
        for the others (COPY, WORKDIR)."""
        if instruction.keyword != "RUN" or instruction.flags.get("network") == "none":
            return "none"
        return self.options.network

    def egress(self, instruction: Instruction) -> dict[str, Any]:
        """A RUN's share of its key from its network: what a RUN fetched is only the answer
        to the same RUN with the same egress (another project's layer made online must
        not answer an offline build, nor one with another allow). Offline adds nothing, so
        offline keys are what they were."""
        network = self.network(instruction)
        return {} if network == "none" else {"network": network.model_dump(mode="json")}

    async def step(self, instruction: Instruction, report: StepReport, key: str,
                   work: Callable[[str], Any]) -> None:
        """The layer ``key``: stored already (a hit), or made by ``work(sandbox_id)`` in a
        sandbox of the image so far, then taken from the sandbox's writable layer."""
        store = self.edge.images.layers
        layer = store.get(key)
        if layer is not None:
            store.touch(key)
            report.cached = True
            self.say(f"[dim]line {instruction.line}: {instruction.keyword} (cached)[/dim]")
        else:
            self.say(f"line {instruction.line}: {_printable(instruction.text)}")
            layer = await self._in_sandbox(instruction, key, work)
        self.layers.append(layer)
        report.layer = layer.digest

    async def _in_sandbox(self, instruction: Instruction, key: str,
                          work: Callable[[str], Any]) -> Layer:
        images = self.edge.images
        # RUN as the USER so far; COPY and WORKDIR as root (their owners are the tar's)
        config = self.config if instruction.keyword == "RUN" else replace(self.config, user="")
        await asyncio.to_thread(images.save_built, self.scratch_name, self.layers, config,
                                {"dockerfile_step": self.name, "edge": self.edge.id})
        opts = self.options
        network = self.network(instruction)
        info = await self.edge.create(CreateRequest(
            substrate="container", image=self.scratch_name, network=network, cpu=opts.cpu,
            memory_mb=opts.memory_mb, disk_mb=opts.disk_mb,
            ttl_s=int(opts.step_timeout_s) + 600, labels={"dsec.build": self.name}))
        try:
            await work(info.id)
            source = {"dockerfile": self.name, "line": instruction.line,
                      "instruction": instruction.text[:1000]}
            digest, dropped = await self.edge.commit_layer(info.id, key, source,
                                                           opts.disk_mb << 20)
            if dropped:
                self.say(f"[yellow]dropped from the layer (no devices, fifos or sockets in "
                         f"layers): {_printable(', '.join(dropped))}[/yellow]")
            layer = images.layers.get(digest)
            if layer is None:
                raise ImageBuildError(f"layer {digest} vanished as it was made")
            return layer
        finally:
            with contextlib.suppress(DSecError):
                await self.edge.stop(info.id, reason="build step done")

    async def run(self, sandbox_id: str, instruction: Instruction) -> None:
        argv = list(instruction.argv) if instruction.argv is not None else [
            "/bin/sh", "-c", instruction.args]
        req = ExecRequest(command=argv, env=self.args,  # as USER, in WORKDIR: the image's
                          timeout_s=self.options.step_timeout_s, max_output_bytes=1 << 20)
        tail = bytearray()
        result: ExecResult | None = None
        async for event in self.edge.stream(sandbox_id, req):
            if isinstance(event, Output):
                tail += event.data
                del tail[:-TAIL_BYTES]
                for text in event.data.decode(errors="replace").splitlines():
                    self.say(f"[dim]{OUTPUT_MARK}{_printable(text)}[/dim]")
            else:
                result = event
        assert result is not None
        if result.exit_code != 0 or result.timed_out:
            why = "timed out" if result.timed_out else f"exited with {result.exit_code}"
            output = tail.decode(errors="replace")
            shown = "\n".join(_printable(text) for text in output.splitlines())
            raise ImageBuildError(  # the message is printed: the output's escapes are not
                f"Dockerfile line {instruction.line}: {instruction.text} {why}:\n{shown}",
                line=instruction.line, exit_code=result.exit_code, output=output)


async def build_dockerfile(edge: Edge, dockerfile: str, context: Path, name: str,
                           options: BuildOptions | None = None,
                           say: Callable[[str], None] = lambda _: None) -> DockerfileBuild:
    """Build the Dockerfile text ``dockerfile`` with ``context`` as its build context and name
    the result ``name``. A failing step raises ``ImageBuildError`` (exit code, output tail)."""
    options = options or BuildOptions()
    build = _Build(edge, context, name, options, say)
    # the FROM image first: its ENV is substituted in the instructions after FROM
    await build.parent(base_image(dockerfile, options.build_args))
    parent_env = dict(kv.partition("=")[::2] for kv in build.config.env)
    instructions = parse(dockerfile, options.build_args, parent_env)
    steps: list[StepReport] = []
    try:
        for instruction in instructions:
            report = StepReport(instruction.line, instruction.text, cached=False)
            steps.append(report)
            await _apply(build, instruction, report)
        image = await asyncio.to_thread(edge.images.save_built, name, build.layers, build.config,
                                        {"dockerfile": str(context)})
    finally:
        with contextlib.suppress(ImageNotFound):
            await asyncio.to_thread(edge.images.remove, build.scratch_name)
    return DockerfileBuild(image, steps)


async def build_events(edge: Edge, req: ImageBuildRequest,
                       context: bytes) -> AsyncIterator[BuildLog | ImageBuilt]:
    """``build_dockerfile`` of a server build: ``context`` (a plain tar, the client's) is
    extracted by the checked extractor (no names out of the directory, links resolved inside,
    no devices, bytes capped at the tar's own size: only sparse members could claim more)
    into a scratch directory; the build's progress comes as ``BuildLog`` lines (RUN output
    capped at ``MAX_LOG_BYTES`` per build), then the ``ImageBuilt``. Leaving the iteration
    early (the client went away) cancels the build once: its step sandbox stops, its scratch
    image goes, nothing is named."""
    options = BuildOptions(network=req.network, build_args=dict(req.build_args),
                           disk_mb=req.disk_mb, memory_mb=req.memory_mb, cpu=req.cpu)
    logs: asyncio.Queue[BuildLog | None] = asyncio.Queue()
    budget = MAX_LOG_BYTES

    def say(markup: str) -> None:
        nonlocal budget
        text = Text.from_markup(markup).plain
        if text.startswith(OUTPUT_MARK):
            if budget <= 0:
                return
            budget -= len(text)
            if budget <= 0:
                text = f"{OUTPUT_MARK}(output past {MAX_LOG_BYTES >> 20} MiB is not shown)"
        logs.put_nowait(BuildLog(message=text))

    with tempfile.TemporaryDirectory(prefix="dsec-context-") as scratch:
        directory = Path(scratch, "context")
        directory.mkdir()
        if context:  # none: a build of RUN steps only
            await asyncio.to_thread(archive.extract, context, directory,
                                    max_bytes=max(len(context), 1 << 20))
        build = asyncio.create_task(build_dockerfile(edge, req.dockerfile, directory, req.name,
                                                     options, say))
        build.add_done_callback(lambda _: logs.put_nowait(None))
        try:
            while (line := await logs.get()) is not None:
                yield line
            done = build.result()
        finally:
            if not build.done():
                build.cancel()
                _CLEANING.add(build)
                build.add_done_callback(_CLEANING.discard)
                with contextlib.suppress(asyncio.CancelledError, DSecError):
                    # shielded: the server cancels a gone client's request again and again
                    # (anyio), and awaiting the build bare passed each one on to it, so its
                    # clean-up (the step's sandbox, the scratch image) was cut short
                    await asyncio.shield(build)
    yield ImageBuilt(image=done.image.name, digest=done.image.digest, steps_run=done.ran,
                     steps_cached=done.cached)


def sweep_scratch(edge: Edge) -> list[str]:
    """Remove the scratch images of this edge's builds that its server's death cut short (a
    build never outlives its server, and a named image pins its layers against collection
    for good); another edge's, on a shared store, may be building and are left alone."""
    removed = []
    for name, source in edge.images.sources(SCRATCH_PREFIX).items():
        if source.get("edge") == edge.id:
            with contextlib.suppress(ImageNotFound):
                edge.images.remove(name)
                removed.append(name)
    return removed


async def _apply(build: _Build, ins: Instruction, report: StepReport) -> None:
    config = build.config
    if ins.keyword == "FROM":
        pass  # resolved before the instructions were read (build_dockerfile)
    elif ins.keyword == "ARG":
        for key, default in pairs(ins):
            build.args[key] = build.options.build_args.get(key, build.args.get(key, default))
    elif ins.keyword == "ENV":
        env = dict(kv.partition("=")[::2] for kv in config.env)
        env.update(pairs(ins))
        build.config = replace(config, env=tuple(f"{k}={v}" for k, v in env.items()))
    elif ins.keyword == "LABEL":
        labels = dict(kv.partition("=")[::2] for kv in config.labels)
        labels.update(pairs(ins))
        build.config = replace(config, labels=tuple(f"{k}={v}" for k, v in labels.items()))
    elif ins.keyword == "USER":
        build.config = replace(config, user=ins.args.strip())
    elif ins.keyword in ("CMD", "ENTRYPOINT"):
        value = ins.argv if ins.argv is not None else ("/bin/sh", "-c", ins.args)
        build.config = (replace(config, cmd=value) if ins.keyword == "CMD"
                        else replace(config, entrypoint=value))
    elif ins.keyword == "WORKDIR":
        path = posixpath.normpath(posixpath.join(config.working_dir or "/", ins.args.strip()))
        build.config = replace(config, working_dir=path)

        async def mkdir(sandbox_id: str) -> None:
            await build.edge.mkdir(sandbox_id, path, parents=True)
        await build.step(ins, report, build.key(ins, {}), mkdir)
    elif ins.keyword == "RUN":
        await build.step(ins, report, build.key(ins, build.egress(ins)),
                         lambda sid: build.run(sid, ins))
    elif ins.keyword in ("COPY", "ADD"):
        sources, dest = sources_and_dest(ins)
        copy = await asyncio.to_thread(context_copy, build.context, sources, dest,
                                       config.working_dir, ins.keyword, ins.flags.get("chown"),
                                       ins.flags.get("chmod"))

        async def extract(sandbox_id: str) -> None:
            tar = copy
            if not copy.into_dir:  # one file to a path that is a directory of the image: into it
                with contextlib.suppress(DSecError):
                    if (await build.edge.stat(sandbox_id, copy.target)).type == "dir":
                        tar = await asyncio.to_thread(
                            context_copy, build.context, sources, dest, config.working_dir,
                            ins.keyword, ins.flags.get("chown"), ins.flags.get("chmod"), True)
            await build.edge.mkdir(sandbox_id, tar.directory, parents=True)
            # dsec's tar, keeping the tar's owners (root, or --chown): not upload_tar's -o
            result = await build.edge.run(sandbox_id, ExecRequest(
                command=[TAR, "-x", "-C", tar.directory, "-f", "-"],
                stdin_b64=base64.b64encode(tar.tar).decode(), timeout_s=600))
            if result.exit_code != 0:
                raise ImageBuildError(f"Dockerfile line {ins.line}: extracting {ins.keyword} "
                                      f"failed: {result.stderr_bytes[-TAIL_BYTES:].decode(errors='replace')}")
        await build.step(ins, report, build.key(ins, {"context": copy.digest}), extract)
    else:  # the parser admits nothing else
        raise InvalidRequest(f"Dockerfile line {ins.line}: {ins.keyword} is not supported")


def _printable(text: str) -> str:
    """A line of a step's output as plain text for the console (no markup, no escapes)."""
    return "".join(c if c.isprintable() else "?" for c in text).replace("[", "\\[")
