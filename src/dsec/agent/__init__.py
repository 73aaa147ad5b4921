"""The in-sandbox agent: C source, its build, wire codec and asyncio client."""

from .build import agent_binary
from .client import (
    AgentClient,
    AgentError,
    AgentUnavailable,
    Entry,
    Exit,
    Output,
    ProcInfo,
    RunResult,
)

__all__ = [
    "AgentClient",
    "AgentError",
    "AgentUnavailable",
    "Entry",
    "Exit",
    "Output",
    "ProcInfo",
    "RunResult",
    "agent_binary",
]
