"""``dsec cluster status``: the cluster as Ray and the edges report it, read without starting
anything (an observer's poll)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from ..control.placement import Placement
from .ids import NAMESPACE
from .members import Members


def cluster_status(address: str) -> tuple[list[dict[str, Any]], int]:
    """(one dict per edge, number of dead nodes) of the Ray cluster at ``address``."""
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.ERROR)
    try:
        members = Members(None, Placement(), on_dead=lambda edge, reason: None)
        asyncio.run(members.poll())
        return members.describe(), len(members.dead_nodes)
    finally:
        ray.shutdown()
