"""The E2B template records (store/templates.py) on a real SQLite file, and the name check of
compat/e2b_templates.py: a project sees only its own templates, a rebuild keeps the ready
image until it is ready itself, a stale build cannot write over a newer one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dsec.compat.e2b_build import Uploads
from dsec.compat.e2b_templates import TemplateError, Templates, split_name
from dsec.images.store import ImageStore
from dsec.store.templates import TemplateStore


def test_projects_rebuilds_and_stale_builds(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path / "state.db")
    first = store.request("a", "tpl", "tpl-1", "b1", ["default"], 2, 512)
    assert store.get("b", "tpl") is None and store.by_id("b", "tpl-1") is None
    first.status, first.image = "ready", "img:1"
    assert store.update(first)
    second = store.request("a", "tpl", "tpl-ignored", "b2", ["v2"], 2, 512)
    assert (second.template_id, second.status, second.image) == ("tpl-1", "waiting", "img:1")
    first.image = "stale"
    assert not store.update(first)  # build b1 is no longer the template's build
    assert store.get("a", "tpl").image == "img:1"  # type: ignore[union-attr]
    other = store.request("b", "tpl", "tpl-2", "b3", ["default"], 2, 512)
    assert other.template_id == "tpl-2"
    assert not store.delete("b", "tpl-1") and [r.alias for r in store.of_project("a")] == ["tpl"]
    assert store.delete("a", "tpl") and store.get("a", "tpl") is None
    assert store.get("b", "tpl") is not None
    store.close()


@pytest.mark.parametrize("name", ["../x", "a/b", "A", "x y", "x;y", "", "a:b c", "a:", "sn-1",
                                  "a" * 64, "a\nb", "é"])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(TemplateError) as refused:
        split_name(name)
    assert refused.value.status == 400


def test_names_and_tags() -> None:
    assert split_name("my-env_1.0") == ("my-env_1.0", None)
    assert split_name("my-env:v1.2") == ("my-env", "v1.2")


def test_a_build_whose_server_stopped_is_reported_failed(tmp_path: Path) -> None:
    """A build left ``building`` (its server stopped mid-pull) stops being polled forever:
    once its heartbeat is stale, its status is an error saying so, and it is not ready."""
    store = TemplateStore(tmp_path / "state.db")
    templates = Templates(store, ImageStore(tmp_path / "images"), {}, "never", lambda: "p",
                          no_build, Uploads(tmp_path / "uploads"))
    row = store.request("p", "tpl", "tpl-1", "b1", ["default"], 2, 512)
    row.status = "building"
    store.update(row)
    assert templates.status("tpl-1", "b1", 0)["status"] == "building"
    store._db.execute("UPDATE e2b_templates SET updated_at=0")  # its last heartbeat, long ago
    answer = templates.status("tpl-1", "b1", 0)
    assert answer["status"] == "error" and "interrupted" in answer["reason"]["message"]
    assert store.get("p", "tpl").image is None  # type: ignore[union-attr]
    with pytest.raises(TemplateError) as other:
        templates.status("tpl-1", "b2", 0)
    assert other.value.status == 404


def no_build(*_: Any) -> AsyncIterator[Any]:
    raise AssertionError("no build here")
