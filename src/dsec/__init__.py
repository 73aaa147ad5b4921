"""dsec: elastic sandboxes for agentic LLM reinforcement learning and evaluation.

``AsyncClient`` is the asyncio SDK (its sandboxes are ``AsyncSandbox``; ``DSecClient`` is
its former name); ``Client`` and ``Sandbox`` are the blocking facade with the same methods and
signatures. Errors are ``DSecError`` and its subclasses (the tree is in ``dsec.protocol.errors``).
"""

from .client.aio import AsyncClient, CommandResult, DSecClient, OutputChunk
from .client.aio import OutputStream as AsyncOutputStream
from .client.aio import Process as AsyncProcess
from .client.aio import Pty as AsyncPty
from .client.aio import Replay as AsyncReplay
from .client.aio import Sandbox as AsyncSandbox
from .client.aio import Session as AsyncSession
from .client.sync import Client, OutputStream, Process, Pty, Replay, Sandbox, Session
from .protocol.build import ImageBuilt
from .protocol.errors import (
                              CapacityExhausted,
                              CheckpointNotFound,
                              CommandTimeout,
                              DelegationExceeded,
                              DigestMismatch,
                              DSecError,
                              FileNotFound,
                              Forbidden,
                              IdempotencyKeyReused,
                              ImageBuildError,
                              ImageNotFound,
                              InvalidRequest,
                              NotSupported,
                              PayloadTooLarge,
                              PortUnavailable,
                              ProcessExited,
                              ProcessNotFound,
                              ProjectExists,
                              ProjectNotFound,
                              QuotaExceeded,
                              RegistryDenied,
                              RegistryError,
                              RegistryUnreachable,
                              RemoteError,
                              ResultRefused,
                              SandboxDied,
                              SandboxError,
                              SandboxNotFound,
                              ServerUnavailable,
                              SnapshotCorrupt,
                              SnapshotNotFound,
                              StdinClosed,
                              StdinFull,
                              StepInterrupted,
                              TrajectoryDiverged,
                              TrajectoryExists,
                              TrajectoryNotFound,
                              Unauthorized,
                              UnsafeArchive,
)
from .protocol.fn import CodeResult
from .protocol.models import (
                              FileEntry,
                              NetworkPolicy,
                              ProcessInfo,
                              SandboxInfo,
                              Snapshot,
                              StepDiff,
                              StepRecord,
                              TrajectoryInfo,
)
from .protocol.project_models import ProjectInfo, ProjectKey, Quota

__all__ = [
    "AsyncClient", "DSecClient", "AsyncSandbox", "AsyncProcess", "AsyncOutputStream",
    "AsyncSession", "OutputChunk", "CommandResult", "Client", "Sandbox", "Process", "Session",
    "OutputStream", "FileEntry", "ProcessInfo",
    "SandboxInfo", "DSecError", "CapacityExhausted", "CommandTimeout", "FileNotFound",
    "ImageBuildError", "ImageNotFound", "InvalidRequest", "NotSupported", "PayloadTooLarge",
    "ProcessNotFound", "ProcessExited", "StdinClosed", "StdinFull", "Pty", "AsyncPty",
    "SandboxDied", "SandboxError", "SandboxNotFound", "ServerUnavailable", "Unauthorized",
    "Snapshot", "SnapshotCorrupt", "SnapshotNotFound", "CheckpointNotFound",
    "TrajectoryDiverged", "StepInterrupted", "TrajectoryExists", "TrajectoryNotFound",
    "TrajectoryInfo", "StepRecord", "StepDiff", "Replay", "AsyncReplay",
    "QuotaExceeded", "DelegationExceeded", "ProjectNotFound", "ProjectExists", "Forbidden",
    "ProjectInfo", "ProjectKey", "Quota",
    "NetworkPolicy",
    "RemoteError", "ResultRefused", "PortUnavailable", "CodeResult", "ImageBuilt", "UnsafeArchive", "IdempotencyKeyReused",
    "DigestMismatch", "RegistryError", "RegistryUnreachable", "RegistryDenied",
]
__version__ = "0.1.0"
