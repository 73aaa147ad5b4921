"""dsec: elastic sandboxes for agentic LLM reinforcement learning and evaluation.

``DSecClient`` is the asyncio SDK (its sandboxes are ``AsyncSandbox``); ``Client`` and
``Sandbox`` are the blocking facade with the same method names.
"""

from .client.aio import CommandResult, DSecClient, OutputChunk
from .client.aio import OutputStream as AsyncOutputStream
from .client.aio import Process as AsyncProcess
from .client.aio import Replay as AsyncReplay
from .client.aio import Sandbox as AsyncSandbox
from .client.errors import (CapacityExhausted, CommandTimeout, DelegationExceeded, DSecError,
                            FileNotFound, Forbidden, ImageBuildError, ImageNotFound,
                            InvalidRequest, NotSupported, PayloadTooLarge, ProcessNotFound,
                            ProjectExists, ProjectNotFound, QuotaExceeded, SandboxDied,
                            SandboxError, SandboxNotFound, ServerUnavailable, StepInterrupted,
                            TrajectoryDiverged, TrajectoryExists, TrajectoryNotFound,
                            Unauthorized)
from .client.project_models import ProjectInfo, ProjectKey, Quota
from .client.errors import IdempotencyKeyReused, RemoteError, ResultRefused, UnsafeArchive
from .client.fn import CodeResult
from .client.models import (FileEntry, ProcessInfo, SandboxInfo, StepDiff, StepRecord,
                            TrajectoryInfo)
from .client.models import NetworkPolicy
from .client.sync import Client, OutputStream, Process, Replay, Sandbox

__all__ = [
    "DSecClient", "AsyncSandbox", "AsyncProcess", "AsyncOutputStream", "OutputChunk",
    "CommandResult", "Client", "Sandbox", "Process", "OutputStream", "FileEntry", "ProcessInfo",
    "SandboxInfo", "DSecError", "CapacityExhausted", "CommandTimeout", "FileNotFound",
    "ImageBuildError", "ImageNotFound", "InvalidRequest", "NotSupported", "PayloadTooLarge",
    "ProcessNotFound",
    "SandboxDied", "SandboxError", "SandboxNotFound", "ServerUnavailable", "Unauthorized",
    "TrajectoryDiverged", "StepInterrupted", "TrajectoryExists", "TrajectoryNotFound",
    "TrajectoryInfo", "StepRecord", "StepDiff", "Replay", "AsyncReplay",
    "QuotaExceeded", "DelegationExceeded", "ProjectNotFound", "ProjectExists", "Forbidden",
    "ProjectInfo", "ProjectKey", "Quota",
    "NetworkPolicy",
    "RemoteError", "ResultRefused", "CodeResult", "UnsafeArchive", "IdempotencyKeyReused",
]
__version__ = "0.1.0"
