"""Scale-out on Ray: one edge actor per node, power-of-k placement (``dsec.control.placement``),
stateless API replicas (see docs/CLUSTER.md). Needs the ``cluster`` extra (Ray)."""

from ..protocol.errors import NotSupported

try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise NotSupported("scale-out needs Ray: pip install 'dsec[cluster]'") from exc
