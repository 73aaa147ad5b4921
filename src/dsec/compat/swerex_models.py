"""SWE-ReX's wire (``swerex/runtime/abstract.py`` of swe-rex 1.4): the request bodies dsec
accepts and the error bodies it sends, written here without importing swe-rex.

Errors travel as HTTP 511 with ``{"swerexception": {"message", "class_path", "traceback",
"extra_info"}}``; the client imports the module of ``class_path`` and calls the named
attribute with the message. That is code execution on the caller's machine for whoever picks
the class path (``os.system`` would run the message), so dsec only ever sends one of the fixed
class paths in ``CLASS_PATHS``, never text from a sandbox; the message may carry the sandbox's
output and is only ever an exception's argument. The traceback is always empty.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter

from ..protocol.models import _Request

SWEREX_EXCEPTIONS = "swerex.exceptions."
CLASS_PATHS = frozenset({
    SWEREX_EXCEPTIONS + name for name in (
        "SwerexException", "SessionExistsError", "SessionDoesNotExistError",
        "NonZeroExitCodeError", "CommandTimeoutError", "NoExitCodeError",
        "SessionNotInitializedError", "BashIncorrectSyntaxError")
} | {"builtins." + name for name in ("FileNotFoundError", "IsADirectoryError", "ValueError",
                                     "LookupError")})


class SwerexError(Exception):
    """Answered as SWE-ReX's 511: the client raises ``class_path`` with ``message``."""

    def __init__(self, class_name: str, message: str, extra_info: dict[str, str] | None = None) -> None:
        """``extra_info``: text the client sets as the exception's ``extra_info``."""
        path = class_name if "." in class_name else SWEREX_EXCEPTIONS + class_name
        if path not in CLASS_PATHS:
            raise AssertionError(f"not a class path dsec sends: {path}")
        super().__init__(message)
        self.class_path = path
        self.message = message
        self.extra_info = extra_info or {}

    def body(self) -> dict[str, Any]:
        return {"swerexception": {"message": self.message, "class_path": self.class_path,
                                  "traceback": "", "extra_info": self.extra_info}}


class _Body(_Request):
    """Finite numbers and text only, as every dsec request; unknown fields ignored (SWE-ReX's
    models ignore them too)."""

    model_config = ConfigDict(extra="ignore")


class CreateBashSession(_Body):
    startup_source: list[str] = []
    session: str = "default"
    session_type: Literal["bash"] = "bash"
    startup_timeout: float = Field(1.0, ge=0)


class BashAction(_Body):
    command: str
    session: str = "default"
    timeout: float | None = Field(None, ge=0)
    is_interactive_command: bool = False
    is_interactive_quit: bool = False
    check: Literal["silent", "raise", "ignore"] = "raise"
    error_msg: str = ""
    expect: list[str] = []
    action_type: Literal["bash"] = "bash"


class BashInterruptAction(_Body):
    session: str = "default"
    timeout: float = Field(0.2, ge=0)
    n_retry: int = Field(3, ge=0, le=100)
    expect: list[str] = []
    action_type: Literal["bash_interrupt"] = "bash_interrupt"


ACTION: TypeAdapter[BashAction | BashInterruptAction] = TypeAdapter(
    Annotated[BashAction | BashInterruptAction, Field(discriminator="action_type")])


class CloseBashSession(_Body):
    session: str = "default"
    session_type: Literal["bash"] = "bash"


class Command(_Body):
    command: str | list[str]
    timeout: float | None = Field(None, gt=0)
    shell: bool = False
    check: bool = False
    error_msg: str = ""
    env: dict[str, str] | None = None
    cwd: str | None = None
    merge_output_streams: bool = False


class ReadFile(_Body):
    path: str
    encoding: str | None = None
    errors: str | None = None


class WriteFile(_Body):
    content: str
    path: str


def observation(output: str = "", exit_code: int | None = None,
                expect_string: str = "") -> dict[str, Any]:
    return {"output": output, "exit_code": exit_code, "failure_reason": "",
            "expect_string": expect_string, "session_type": "bash"}
