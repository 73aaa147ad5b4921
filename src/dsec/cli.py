"""The ``dsec`` command.

It is installed with the SDK alone (``pip install dsec``): the client commands (run, ls, exec,
trajectory, project) need only the SDK; the server's (serve, image, key, bench, cluster)
import their modules when run, and say which extra to install when those are missing.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any, get_args

import click
from rich.console import Console
from rich.table import Table

from .client.aio import DSecClient
from .client.transport import EXIT_MISSING_EXTRA
from .config import Settings, serve_options
from .protocol.errors import DSecError
from .protocol.models import SnapshotMode

console = Console(stderr=True)


def _fail(exc: DSecError) -> None:
    console.print(f"[red]error[/red] ({exc.code}): {exc.message}")
    sys.exit(1)


def _run(coro: Any) -> Any:
    try:
        return asyncio.run(coro)
    except DSecError as exc:
        _fail(exc)


# Modules of the extras (top-level names) -> what to install for them.
EXTRAS = {**dict.fromkeys(["fastapi", "starlette", "uvicorn", "uvloop", "httptools", "anyio",
                           "httpx", "prometheus_client", "pyroute2", "psycopg"],
                          "the server: pip install 'dsec[server]'"),
          "ray": "the cluster extra: pip install 'dsec[cluster]'",
          "dsec_benchmarks": "the benchmarks of a dsec checkout: pip install -e ./benchmarks "
                             "(scripts/setup does)"}


SNAPSHOT_MODE = click.Choice(get_args(SnapshotMode))


class MissingExtra(click.ClickException):
    """A command whose dependencies are not installed (its exit code tells the SDK's autostart)."""

    exit_code = EXIT_MISSING_EXTRA


class Commands(click.Group):
    """Turns a missing optional dependency into ``MissingExtra`` naming what to install."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as exc:
            needed = EXTRAS.get((exc.name or "").partition(".")[0])
            if needed is None:
                raise
            raise MissingExtra(f"dsec {ctx.invoked_subcommand} needs {needed} "
                               f"(module {exc.name!r} is missing)") from exc


@click.group(cls=Commands)
@click.version_option(package_name="dsec")
def main() -> None:
    """dsec: elastic sandboxes for agentic RL and evaluation."""


@main.command()
@serve_options
def serve(**options: Any) -> None:
    """Run the API server with an embedded edge on this host (or over a Ray cluster).

    Every option may be given as a DSEC_* environment variable instead (see README)."""
    from .server import serve as run_server
    settings = Settings.load(**options)
    where = (f"http://{settings.host}:{settings.port}" if settings.host
             else f"unix://{settings.socket_path}")
    if settings.log_format == "text":
        console.print(f"dsec serving on {where} (state in {settings.state_dir})")
    run_server(settings)


@main.command()
@click.argument("command")
@click.option("--image", default="debian-minbase")
@click.option("--substrate", default="container")
@click.option("--timeout", "timeout_s", type=float, default=60.0)
def run(command: str, image: str, substrate: str, timeout_s: float) -> None:
    """Create a sandbox, run COMMAND in it, print its output, stop it."""
    async def go() -> int:
        async with DSecClient() as client:
            started = time.perf_counter()
            async with await client.create(substrate=substrate, image=image) as sb:
                result = await sb.run(command, timeout_s=timeout_s)
            console.print(f"[dim]{sb.id}: exit {result.exit_code} in "
                          f"{(time.perf_counter() - started) * 1000:.0f} ms[/dim]")
            sys.stdout.buffer.write(result.stdout_bytes)
            sys.stderr.buffer.write(result.stderr_bytes)
            return result.exit_code
    sys.exit(_run(go()))


@main.command("ls")
def list_sandboxes() -> None:
    """List live sandboxes."""
    async def go() -> None:
        async with DSecClient() as client:
            table = Table("id", "substrate", "image", "state", "expires in")
            for s in await client.list():
                table.add_row(s.id, s.substrate, s.image, s.state, f"{s.expires_at - time.time():.0f}s")
            Console().print(table)
    _run(go())


@main.command("exec")
@click.argument("sandbox_id")
@click.argument("command")
@click.option("--timeout", "timeout_s", type=float, default=60.0)
def exec_(sandbox_id: str, command: str, timeout_s: float) -> None:
    """Run COMMAND in a live sandbox, streaming its output."""
    async def go() -> int:
        async with DSecClient() as client:
            stream = (await client.get(sandbox_id)).stream(command, timeout_s=timeout_s)
            async for chunk in stream:
                out = sys.stdout if chunk.stream == "stdout" else sys.stderr
                out.buffer.write(chunk.data)
                out.flush()
            assert stream.result is not None
            return stream.result.exit_code
    sys.exit(_run(go()))


def _on_each(sandbox_ids: tuple[str, ...], action: str) -> None:
    """Call the SDK's ``action`` (stop, pause, resume) on each sandbox, echoing its id."""
    async def go() -> None:
        async with DSecClient() as client:
            for sandbox_id in sandbox_ids:
                await getattr(await client.get(sandbox_id), action)()
                click.echo(sandbox_id)
    _run(go())


@main.command()
@click.argument("sandbox_ids", nargs=-1, required=True)
def stop(sandbox_ids: tuple[str, ...]) -> None:
    """Stop sandboxes."""
    _on_each(sandbox_ids, "stop")


@main.command()
@click.argument("sandbox_ids", nargs=-1, required=True)
def pause(sandbox_ids: tuple[str, ...]) -> None:
    """Freeze sandboxes (no CPU); any later call on one resumes it."""
    _on_each(sandbox_ids, "pause")


@main.command()
@click.argument("sandbox_ids", nargs=-1, required=True)
def resume(sandbox_ids: tuple[str, ...]) -> None:
    """Let paused sandboxes run again."""
    _on_each(sandbox_ids, "resume")


@main.command()
@click.argument("sandbox_id")
@click.option("-n", "count", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="how many children")
@click.option("--ttl", "ttl_s", type=int, default=None,
              help="the children's TTL (seconds; default: the parent's)")
@click.option("--mode", type=SNAPSHOT_MODE, default="filesystem", show_default=True,
              help="full: memory and processes too (VMs)")
def fork(sandbox_id: str, count: int, ttl_s: int | None, mode: str) -> None:
    """Start N sandboxes from SANDBOX_ID's file system now (one snapshot, deleted after),
    with its limits and network policy: prints each child's id, or the error that stopped
    it (exit status 1 if any failed)."""
    async def go() -> int:
        async with DSecClient() as client:
            options: dict[str, Any] = {} if ttl_s is None else {"ttl_s": ttl_s}
            children = await (await client.get(sandbox_id)).fork(count, mode=mode, **options)
        for child in children:
            click.echo(f"error: {child.code}: {child.message}" if isinstance(child, DSecError)
                       else child.id)
        return int(any(isinstance(child, DSecError) for child in children))
    sys.exit(_run(go()))


@main.group()
def snapshot() -> None:
    """Take, list and delete snapshots (``Sandbox.snapshot``)."""


@snapshot.command("take")
@click.argument("sandbox_id")
@click.option("--ttl", "ttl_s", type=int, default=None,
              help="delete it this many seconds later (default: keep until rm)")
@click.option("--mode", type=SNAPSHOT_MODE, default="filesystem", show_default=True,
              help="full: memory and processes too (VMs)")
def snapshot_take(sandbox_id: str, ttl_s: int | None, mode: str) -> None:
    """Snapshot SANDBOX_ID's file system (and with --mode full its memory); prints the
    snapshot's id."""
    async def go() -> None:
        async with DSecClient() as client:
            sandbox = await client.get(sandbox_id)
            click.echo((await sandbox.snapshot(mode, ttl_s=ttl_s)).id)
    _run(go())


@snapshot.command("ls")
def snapshot_ls() -> None:
    """List the snapshots your key may see."""
    async def go() -> None:
        async with DSecClient() as client:
            table = Table("id", "of sandbox", "size", "age", "expires in")
            for s in await client.snapshots():
                expires = "-" if s.expires_at is None else f"{s.expires_at - time.time():.0f}s"
                table.add_row(s.id, s.sandbox_id, f"{s.size_bytes / (1 << 20):.1f} MB",
                              f"{time.time() - s.created_at:.0f}s", expires)
            Console().print(table)
    _run(go())


@snapshot.command("rm")
@click.argument("snapshot_ids", nargs=-1, required=True)
def snapshot_rm(snapshot_ids: tuple[str, ...]) -> None:
    """Delete snapshots (sandboxes started from one keep running)."""
    async def go() -> None:
        async with DSecClient() as client:
            for snapshot_id in snapshot_ids:
                await client.delete_snapshot(snapshot_id)
                click.echo(snapshot_id)
    _run(go())


@main.command()
@click.option("--dry-run", is_flag=True, help="report what would be removed; remove nothing")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def gc(dry_run: bool, as_json: bool) -> None:
    """Collect garbage now (admin key): remove what is past the server's retention (ended
    sandboxes' records and events, failed creates, expired trajectories, unreferenced
    blobs...) and report it by kind, count and bytes."""
    async def go() -> None:
        async with DSecClient() as client:
            report = await client.gc(dry_run=dry_run)
        if as_json:
            click.echo(report.model_dump_json())
            return
        table = Table("kind", "would remove" if dry_run else "removed", "bytes")
        for r in report.removed:
            table.add_row(r.kind, str(r.count), str(r.bytes))
        Console().print(table)
    _run(go())


@main.group()
def trajectory() -> None:
    """Show, export and replay trajectory logs."""


@trajectory.command("ls")
@click.option("--limit", type=int, default=50)
def trajectory_ls(limit: int) -> None:
    """List the most recent trajectories."""
    async def go() -> None:
        async with DSecClient() as client:
            table = Table("id", "generation", "steps", "sandbox", "state", "created")
            for t in await client.trajectories(limit):
                table.add_row(t.id, str(t.generation), str(t.steps), t.sandbox.id,
                              t.sandbox.state, _when(t.created_at))
            Console().print(table)
    _run(go())


@trajectory.command("show")
@click.argument("trajectory_id")
@click.option("--generation", type=int, default=None, help="default: the current one")
def trajectory_show(trajectory_id: str, generation: int | None) -> None:
    """Show a trajectory and its logged steps."""
    async def go() -> None:
        async with DSecClient() as client:
            info = await client.trajectory(trajectory_id)
            steps = await client.trajectory_steps(trajectory_id, generation)
        out = Console()
        out.print(f"[bold]{info.id}[/bold]  created {_when(info.created_at)} by "
                  f"{info.created_by or '?'}; {info.steps} steps in generation {info.generation}")
        for g in info.generations:
            fork = f", forked at step {g.forked_at_step}" if g.forked_at_step else ""
            differ = (f", replay differed at {g.replay_differences}" if g.replay_differences else "")
            out.print(f"  generation {g.generation}: {g.sandbox_id} ({g.sandbox_state}"
                      f"{': ' + g.sandbox_reason if g.sandbox_reason else ''}) "
                      f"{g.image}@{g.image_digest[:19]}{fork}{differ}")
        table = Table("step", "op", "request", "result", "ms", "at", "checkpoint",
                      title=f"generation {generation or info.generation}")
        for s in steps:
            took = f"{(s.ended_at - s.started_at) * 1000:.0f}" if s.ended_at else ""
            table.add_row(str(s.step), s.op, _request_text(s.request), _result_text(s),
                          took, _when(s.started_at), s.checkpoint or "")
        out.print(table)
    _run(go())


@trajectory.command("export")
@click.argument("trajectory_id")
@click.option("--format", "fmt", type=click.Choice(["jsonl"]), default="jsonl")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="write here instead of stdout")
def trajectory_export(trajectory_id: str, fmt: str, output: Path | None) -> None:
    """Export a trajectory for provenance: one JSON object per line (the trajectory, then
    every step of every generation, with full requests and results)."""
    async def go() -> None:
        out = open(output, "w") if output else sys.stdout
        try:
            async with DSecClient() as client:
                async for line in client.export_trajectory(trajectory_id):
                    out.write(json.dumps(line) + "\n")
        finally:
            if output:
                out.close()
    _run(go())


@trajectory.command("fork")
@click.argument("trajectory_id")
@click.option("--at-step", type=int, required=True, help="the checkpointed step to fork at")
@click.option("-n", type=int, default=1, show_default=True, help="how many forks")
def trajectory_fork(trajectory_id: str, at_step: int, n: int) -> None:
    """New sandboxes from a step's checkpoint, each on a new trajectory holding the steps up
    to it (nothing re-executed); prints each new trajectory id and its sandbox id."""
    async def go() -> None:
        async with DSecClient() as client:
            for fork in await client.fork_trajectory(trajectory_id, at_step, n):
                click.echo(f"{fork.trajectory} {fork.id}")
    _run(go())


@trajectory.command("rm")
@click.argument("trajectory_ids", nargs=-1, required=True)
def trajectory_rm(trajectory_ids: tuple[str, ...]) -> None:
    """Delete trajectories: their sandboxes stopped, their logs and checkpoints deleted."""
    async def go() -> None:
        async with DSecClient() as client:
            for trajectory_id in trajectory_ids:
                await client.delete_trajectory(trajectory_id)
                click.echo(trajectory_id)
    _run(go())


@trajectory.command("replay")
@click.argument("trajectory_id")
@click.option("--upto", type=int, default=None, help="last step to replay")
@click.option("--keep", is_flag=True, help="keep the sandbox it replayed into")
@click.option("--no-restore", is_flag=True,
              help="re-execute every step, even where a checkpoint could be restored")
def trajectory_replay(trajectory_id: str, upto: int | None, keep: bool, no_restore: bool) -> None:
    """Replay a trajectory into a new sandbox and show where results differ (from its
    newest checkpoint at or before --upto, if it has checkpoints)."""
    async def go() -> int:
        async with DSecClient() as client:
            replay = await client.replay(trajectory_id, upto=upto, restore=not no_restore)
            if not keep:
                await replay.sandbox.stop()
        table = Table("step", "op", "differs in", "logged", "replayed",
                      title=f"replay of {trajectory_id} into {replay.sandbox.id}")
        for d in replay.differences:
            table.add_row(str(d.step), d.op, ", ".join(d.fields), _brief(d.logged), _brief(d.replayed))
        Console().print(table)
        restored = (f"restored the checkpoint of step {replay.restored_step}, "
                    if replay.restored_step is not None else "")
        console.print(f"{restored}{len(replay.steps)} steps replayed, "
                      f"{len(replay.differences)} differ"
                      + (f"; sandbox {replay.sandbox.id} kept" if keep else ""))
        return 1 if replay.differences else 0
    sys.exit(_run(go()))


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _request_text(request: dict[str, Any]) -> str:
    params = request.get("params", {})
    text = params.get("command", params.get("path", params.get("process", "")))
    if isinstance(text, list):
        text = " ".join(text)
    extra = f" ({request['payload']['size']} B)" if request.get("payload") else ""
    text = str(text).replace("\n", "; ")
    return (text[:60] + "…" if len(text) > 60 else text) + extra


def _result_text(step: Any) -> str:
    if step.status in ("running", "interrupted"):
        return step.status
    outcome = step.outcome or {}
    if "error" in outcome:
        return f"[red]{outcome['error']['code']}[/red]"
    value = outcome.get("value")
    if isinstance(value, dict) and "exit_code" in value:
        size = sum(ref["size"] for ref in outcome.get("bytes", {}).values())
        flags = "".join(f" {k}" for k in ("timed_out", "oom_killed") if value.get(k))
        return f"exit {value['exit_code']}, {size} B{flags}"
    if "data" in outcome.get("bytes", {}):
        return f"{outcome['bytes']['data']['size']} B"
    return "ok"


def _brief(values: dict[str, Any]) -> str:
    return "; ".join(f"{k}={v.get('text', v)!r}"[:80] if isinstance(v, dict) else f"{k}={v!r}"[:80]
                     for k, v in values.items())


@main.group()
def image() -> None:
    """Build, list, import and pull images."""


@image.command("build")
@click.argument("spec", required=False)
@click.option("-f", "--file", "dockerfile", type=click.Path(exists=True, dir_okay=False,
              path_type=Path), default=None,
              help="build this Dockerfile; SPEC is then its build context (default: .)")
@click.option("--name", default=None, help="the built image's name (required with -f)")
@click.option("--build-arg", "build_args", multiple=True, metavar="NAME=VALUE",
              help="a value for an ARG of the Dockerfile (repeatable)")
@click.option("--allow", "allow", multiple=True, metavar="SERVICE|RULE",
              help="egress of RUN steps: a service of the server's table (pypi, npm, ...) or "
                   "a raw rule (host:port, CIDR); without: RUN steps have no network")
@click.option("--disk-mb", default=4096, show_default=True, help="each step's disk (its layer "
              "can hold no more)")
@click.option("--memory-mb", default=2048, show_default=True)
@click.option("--server", "on_server", is_flag=True,
              help="with -f: build on the server the SDK reaches (DSEC_URL and DSEC_API_KEY, "
                   "else this host's local server), the context sent as a tar")
def image_build(spec: str | None, dockerfile: Path | None, name: str | None,
                build_args: tuple[str, ...], allow: tuple[str, ...], disk_mb: int,
                memory_mb: int, on_server: bool) -> None:
    """Build SPEC (a TOML file, or a built-in name such as python-3.11), or with -f a
    Dockerfile (each RUN, COPY and WORKDIR step in a dsec container sandbox; with --server,
    on the server, the context directory sent as a tar)."""
    if dockerfile is not None:
        _dockerfile_build(dockerfile, Path(spec or "."), name, build_args, allow, disk_mb,
                          memory_mb, on_server)
        return
    if spec is None:
        raise click.UsageError("give a SPEC, or -f Dockerfile")
    from .images.spec import load_spec
    from .images.store import ImageStore
    try:
        built = ImageStore().build(load_spec(spec), console=console)
    except DSecError as exc:
        _fail(exc)
    click.echo(f"{built.name} {built.digest}")


def _dockerfile_build(dockerfile: Path, context: Path, name: str | None,
                      build_args: tuple[str, ...], allow: tuple[str, ...], disk_mb: int,
                      memory_mb: int, on_server: bool) -> None:
    from .edge.assemble import builder_edge
    from .edge.dockerbuild import BuildOptions, build_dockerfile
    from .protocol.build import allow_network
    if not name:
        raise click.UsageError("--name is required with -f")
    if any("=" not in arg for arg in build_args):
        raise click.UsageError("--build-arg takes NAME=VALUE")
    args = dict(arg.partition("=")[::2] for arg in build_args)
    try:
        network = allow_network(allow)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--allow") from None
    options = BuildOptions(network=network, build_args=args, disk_mb=disk_mb, memory_mb=memory_mb)

    async def build() -> tuple[str, str, int, int]:
        if on_server:  # built there (POST /v1/images/build), as client.build_image
            async with DSecClient() as client:
                built = await client.build_image(
                    name, context, dockerfile=dockerfile, build_args=args, network=network,
                    disk_mb=disk_mb, memory_mb=memory_mb,
                    on_log=lambda line: console.print(line, markup=False, highlight=False))
            return built.image, built.digest, built.steps_run, built.steps_cached
        async with builder_edge(Settings.load()) as edge:
            result = await build_dockerfile(edge, dockerfile.read_text(), context, name, options,
                                            say=console.print)
        return result.image.name, result.image.digest, result.ran, result.cached
    try:
        image, digest, ran, cached = asyncio.run(build())
    except DSecError as exc:
        _fail(exc)
    console.print(f"{ran} steps run, {cached} cached")
    click.echo(f"{image} {digest}")


@image.command("ls")
def image_ls() -> None:
    """List images in the store."""
    from .images.store import ImageStore
    table = Table("name", "digest", "layers", "size")
    for img in ImageStore().list():
        table.add_row(img.name, img.digest[:19], str(len(img.layers)), f"{img.size_bytes / 1e6:.0f} MB")
    Console().print(table)


@image.command("import")
@click.argument("archive", type=click.Path(exists=True, path_type=Path))
@click.option("--name", required=True, help="name to give the imported image")
def image_import(archive: Path, name: str) -> None:
    """Import an OCI image archive (or a docker save archive)."""
    from .images.store import ImageStore
    try:
        imported = ImageStore().import_oci(archive, name)
    except DSecError as exc:
        _fail(exc)
    click.echo(f"{imported.name} {imported.digest}")


@image.command("pull")
@click.argument("ref")
@click.option("--platform", default=None, help="os/arch[/variant] of a multi-platform image "
              "(default: linux and this host's architecture)")
def image_pull(ref: str, platform: str | None) -> None:
    """Pull REF (e.g. python:3.11-slim, registry.example/team/task:1.2, name@sha256:...) from its
    registry; credentials from the docker config file or DSEC_REGISTRY_AUTH."""
    from .images.store import ImageStore
    try:
        pulled = ImageStore().pull(ref, platform=platform, console=console)
    except DSecError as exc:
        _fail(exc)
    click.echo(f"{pulled.name} {pulled.digest}")


@main.group()
def key() -> None:
    """Manage API keys."""


@key.command("create")
@click.argument("name")
@click.option("--project", default=None,
              help="the key's project: it sees and creates that project's sandboxes only "
                   "(without: an admin key, which sees everything)")
@click.option("--state-dir", type=click.Path(path_type=Path), default=None,
              help="the server's state directory [env DSEC_STATE_DIR]")
@click.option("--state-url", default=None,
              help="the servers' state store, e.g. postgresql://... (default: SQLite in the "
                   "state dir) [env DSEC_STATE_URL]")
def key_create(name: str, project: str | None, state_dir: Path | None, state_url: str | None) -> None:
    """Create an API key named NAME and print its secret (shown once)."""
    from .store.sqlite import StateStore
    store = StateStore(Settings.load(state_dir=state_dir, state_url=state_url).store_target)
    if project is None:
        key_id, secret, _ = store.create_key(name)
        console.print(f"created admin key {key_id}; use it as DSEC_API_KEY")
    else:
        from .control.project_keys import create_project_key
        try:
            key_id, secret = create_project_key(store, name, project)
        except DSecError as exc:
            _fail(exc)
        console.print(f"created {key_id} of project {project}; use it as DSEC_API_KEY")
    click.echo(secret)


@main.group()
def project() -> None:
    """Projects and their quotas (through the server, with your key)."""


def _quota_text(p: Any) -> str:
    return (f"{p.used.sandboxes}/{p.quota.sandboxes} sandboxes, {p.used.cpu:g}/{p.quota.cpu:g} "
            f"cpu, {p.used.memory_mb}/{p.quota.memory_mb} MB, "
            f"{p.used.snapshot_bytes}/{p.quota.snapshot_bytes} snapshot bytes")


def _print_projects(projects: list[Any]) -> None:
    table = Table("project", "parent", "sandboxes", "cpu", "memory MB", "delegated")
    for p in projects:
        table.add_row(p.name, p.parent or "-", f"{p.used.sandboxes}/{p.quota.sandboxes}",
                      f"{p.used.cpu:g}/{p.quota.cpu:g}", f"{p.used.memory_mb}/{p.quota.memory_mb}",
                      f"{p.delegated.sandboxes} sb, {p.delegated.cpu:g} cpu, "
                      f"{p.delegated.memory_mb} MB")
    Console().print(table)


@project.command("create")
@click.argument("name")
@click.option("--parent", default=None,
              help="the project that delegates the quota (default: your key's project)")
@click.option("--sandboxes", type=int, default=0, help="concurrent sandboxes")
@click.option("--cpu", type=float, default=0.0, help="CPUs (cores)")
@click.option("--memory-mb", type=int, default=0, help="memory (MB)")
@click.option("--snapshot-bytes", type=int, default=0,
              help="bytes its snapshots may hold (each: its sandbox's disk_mb)")
def project_create(name: str, parent: str | None, sandboxes: int, cpu: float,
                   memory_mb: int, snapshot_bytes: int) -> None:
    """Create project NAME under PARENT with a quota delegated from the parent's."""
    async def go() -> None:
        async with DSecClient() as client:
            p = await client.projects().create(name, parent=parent, sandboxes=sandboxes,
                                               cpu=cpu, memory_mb=memory_mb,
                                               snapshot_bytes=snapshot_bytes)
        click.echo(f"{p.name}: {_quota_text(p)}")
    _run(go())


@project.command("ls")
def project_ls() -> None:
    """List the projects your key may see."""
    async def go() -> None:
        async with DSecClient() as client:
            _print_projects(await client.projects().list())
    _run(go())


@project.command("show")
@click.argument("name")
def project_show(name: str) -> None:
    """Show a project's quota, use and delegation."""
    async def go() -> None:
        async with DSecClient() as client:
            _print_projects([await client.projects().get(name)])
    _run(go())


@project.command("quota")
@click.argument("name")
@click.option("--sandboxes", type=int, default=None)
@click.option("--cpu", type=float, default=None)
@click.option("--memory-mb", type=int, default=None)
@click.option("--snapshot-bytes", type=int, default=None)
def project_quota(name: str, sandboxes: int | None, cpu: float | None,
                  memory_mb: int | None, snapshot_bytes: int | None) -> None:
    """Set NAME's quota (what its parent delegates to it); unset options keep their value."""
    async def go() -> None:
        async with DSecClient() as client:
            p = await client.projects().set_quota(name, sandboxes=sandboxes, cpu=cpu,
                                                  memory_mb=memory_mb,
                                                  snapshot_bytes=snapshot_bytes)
        click.echo(f"{p.name}: {_quota_text(p)}")
    _run(go())


@main.command()
@click.option("--quick", is_flag=True, help="smaller counts, for a smoke run")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None,
              help="also write the figures as JSON here")
@click.option("--only", type=click.Choice(["create", "create-parts", "warm", "fn", "microvm", "vm", "cluster", "projects",
                                           "network", "state", "pause", "stdin", "soak",
                                           "pull", "lazy", "connect", "density",
                                           "throughput", "exec", "trajectory"]),
              default=None,
              help="run one series alone: create (cold creates one at a time and in a "
                   "burst, stops, against bare crun), create-parts (crun run with dsec's "
                   "container config, one difference at a time, against crun spec's), warm (creates from a warm pool, one at a time and "
                   "in a burst, and a burst from a pool a burst grew, against bare crun), fn (call latency and throughput), microvm or vm "
                   "(against containers), cluster (a local Ray cluster against one node), "
                   "projects (nested-project key against the admin key), network (policy cost "
                   "on create, set_network), state (snapshot, create from one, fork, rollback), "
                   "pause (pause, resume, a call on a paused sandbox), stdin (input to a "
                   "process, a terminal's round trip, stdin throughput), soak (server "
                   "resources over many create/run/stop cycles, retention set short), pull "
                   "(a registry pull and conversion against skopeo copy to a directory), lazy "
                   "(bytes a sandbox reads of a 1 GiB image; cold and warm first create), "
                   "connect (dsec's Connect server and codec against the connectrpc library), "
                   "density (N idle containers: create rate, memory each, an exec in each, "
                   "stops, leftovers), throughput (create_many of N against bare crun starts; "
                   "stops), exec (the round trip of `true` against crun exec), trajectory (log "
                   "overhead per call, fast-forward). Without --only: the latency series, then "
                   "throughput and density")
@click.option("--sizes", default="100", help="cluster series: burst sizes, comma-separated")
@click.option("--cycles", type=click.IntRange(min=10), default=None,
              help="soak series: create/run/stop cycles (default 20000; --quick 200)")
@click.option("--count", type=click.IntRange(min=1), default=None,
              help="density series: idle sandboxes (default 3000; --quick 20); throughput: "
                   "sandboxes of the create_many (default 1000; --quick 50)")
@click.option("--settle", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="LOAD", help="start each series once the 1-minute load average is "
                                   "under LOAD (waiting up to 10 minutes); every row records "
                                   "the load its series started at")
def bench(quick: bool, json_out: Path | None, only: str | None,
          sizes: str, cycles: int | None, count: int | None, settle: float | None) -> None:
    """Run the benchmark against bare crun and print the figures (see docs/BENCHMARKS.md).
    Exits non-zero when a series had failures (never on a figure)."""
    if settle is not None and only in ("fn", "microvm", "vm"):
        raise click.UsageError("--settle is not an option of --only fn, microvm or vm")
    if cycles is not None and only != "soak":
        raise click.UsageError("--cycles is an option of --only soak")
    if count is not None and only not in ("density", "throughput"):
        raise click.UsageError("--count is an option of --only density and --only throughput")
    if only == "fn":
        return _benchmark("bench_fn").main(quick=quick, json_out=json_out)
    if only in ("microvm", "vm"):
        return _benchmark("bench_vm").main(only, quick=quick, json_out=json_out)
    _benchmark("bench").main(quick=quick, json_out=json_out, only=only,
                             sizes=[int(n) for n in sizes.split(",")], cycles=cycles, count=count,
                             settle=settle)


def _benchmark(name: str) -> Any:
    """A module of the benchmarks: package ``dsec_benchmarks``, installed from a checkout and not
    with dsec (so not a static import of the package)."""
    return importlib.import_module(f"dsec_benchmarks.{name}")


@main.group()
def cluster() -> None:
    """A dsec cluster on Ray (see docs/CLUSTER.md)."""


@cluster.command("status")
@click.option("--ray", "ray_address", default=None,
              help="Ray cluster address (default $DSEC_RAY_ADDRESS, else this host's cluster)")
def cluster_status(ray_address: str | None) -> None:
    """Nodes, their edge's capacity and load, and sandboxes per substrate."""
    from .cluster.status import cluster_status as status
    edges, dead = status(Settings.load(ray_address=ray_address).ray_address or "auto")
    table = Table("edge", "node", "state", "capacity", "load", "sandboxes")
    for e in sorted(edges, key=lambda e: e["id"]):
        state = "healthy" if e["healthy"] else ("unreachable" if e["alive"] else "dead")
        per_substrate = ", ".join(f"{k}: {v}" for k, v in sorted(e["sandboxes"].items())) or "-"
        table.add_row(e["id"], e["node"][:12], state, str(e["capacity"]), str(e["load"]),
                      per_substrate)
    Console().print(table)
    total = sum(e["capacity"] or 0 for e in edges if e["healthy"])
    load = sum(e["load"] or 0 for e in edges if e["healthy"])
    click.echo(f"{len(edges)} edges, load {load} of {total}; {dead} dead nodes")
