"""Drives dsec's E2B template API with the real ``e2b`` SDK (``Template``, and the SDK's own
generated API client for list and delete, which ``Template`` does not wrap).

Run with an interpreter of the e2b compat virtualenv, E2B_API_URL / E2B_SANDBOX_URL /
E2B_API_KEY pointing at dsec, and a JSON list of steps as argv[1]: ``[name, *args]``. It prints
a JSON list, one result per step: its value, or the class and message of what it raised. The
test decides what is right.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from e2b import AsyncTemplate, Sandbox, Template
from e2b.api.client.api.templates import delete_templates_template_id, get_templates
from e2b.api.client_sync import get_api_client
from e2b.connection_config import ConnectionConfig


def _client() -> Any:
    return get_api_client(ConnectionConfig())


def exists(name: str) -> Any:
    return [Template.exists(name), Template.alias_exists(name)]


def build(name: str, image: str, extra: str = "", workdir: str = "/data") -> Any:
    template = (Template().from_image(image).set_envs({"TPL_GREETING": "from-template"})
                .set_workdir(workdir))
    if extra == "run":
        template = template.run_cmd("echo hi > /data/x")
    elif extra == "copy":
        template = template.copy(os.path.basename(__file__), "/data/")  # context: this dir
    elif extra == "steps":  # RUN and COPY (the files uploaded), as users write templates
        template = (template.run_cmd(["echo built-$TPL_GREETING > /data/x",
                                      f"echo step-output-{name}"])  # its own: not cached
                    .copy(os.path.basename(__file__), "/data/copied/")
                    .run_cmd("wc -c < /data/copied/compat_e2b_template_driver.py > /data/size",
                             user="root"))
    elif extra == "failing":
        template = template.run_cmd(f"echo about-to-fail {name}; printf 'esc\\033[2J\\n'; exit 5")
    elif extra == "template":  # ``image`` names a template: its env and workdir carry over
        template = Template().from_template(image)
    elif extra == "dockerfile":
        template = Template().from_dockerfile(f"FROM {image}\nENV TPL_GREETING=dockerfile\n"
                                              "WORKDIR /etc\n")
    logs: list[str] = []
    info = Template.build(template, name, on_build_logs=lambda entry: logs.append(entry.message))
    return {"template_id": info.template_id, "build_id": info.build_id, "logs": logs}


def background(name: str, image: str) -> Any:
    info = Template.build_in_background(Template().from_image(image), name)
    status = Template.get_build_status(info, logs_offset=0)
    return {"template_id": info.template_id, "status": status.status.value}


def async_build(name: str, image: str) -> Any:
    """What harbor's E2B environment does: AsyncTemplate, in the background, polled."""
    async def go() -> Any:
        before = await AsyncTemplate.exists(name)
        info = await AsyncTemplate.build_in_background(Template().from_image(image), name)
        status = await AsyncTemplate.get_build_status(info)
        while status.status.value in ("waiting", "building"):
            await asyncio.sleep(0.2)
            status = await AsyncTemplate.get_build_status(info)
        return {"exists": [before, await AsyncTemplate.exists(name)],
                "status": status.status.value}
    return asyncio.run(go())


def run(name: str, command: str) -> Any:
    sandbox = Sandbox.create(template=name, timeout=120)
    try:
        result = sandbox.commands.run(command)
        return {"stdout": result.stdout, "exit_code": result.exit_code}
    finally:
        sandbox.kill()


def tags(name: str) -> Any:
    return sorted(t.tag for t in Template.get_tags(name))


def listing() -> Any:
    response = get_templates.sync_detailed(client=_client())
    return {"status": response.status_code,
            "templates": [{"aliases": t.aliases, "template_id": t.template_id,
                           "status": t.build_status.value} for t in response.parsed or []]}


def delete(template_id: str) -> Any:
    return delete_templates_template_id.sync_detailed(template_id, client=_client()).status_code


STEPS = {"exists": exists, "build": build, "background": background, "run": run,
         "list": listing, "delete": delete, "tags": tags, "async_build": async_build}


def main() -> None:
    results = []
    for name, *args in json.loads(sys.argv[1]):
        try:
            results.append(STEPS[name](*args))
        except Exception as exc:  # recorded, not fatal
            results.append({"raised": type(exc).__name__, "message": str(exc)[:800],
                            "mro": [c.__name__ for c in type(exc).__mro__]})
    print(json.dumps(results), flush=True)
    # Without the interpreter's finalization: the 2.63 SDK's native teardown at exit aborts
    # (SIGABRT) now and then, after everything is printed (see compat_e2b_driver.py).
    os._exit(0)


if __name__ == "__main__":
    main()
