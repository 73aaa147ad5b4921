"""Names in the cluster: an edge's id from its Ray node, the edge actor's name."""

from __future__ import annotations

NAMESPACE = "dsec"


def edge_id_for(node_id: str) -> str:
    """An edge id from a Ray node id (hex, no dashes: sandbox ids stay ``sb-<edge>-<rand>``)."""
    return "r" + node_id[:8]


def actor_name(edge_id: str) -> str:
    return f"dsec-edge-{edge_id}"
