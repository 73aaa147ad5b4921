"""The fn substrate's wire models: a ``run_code`` request and its result, and the image calls
run in by default. Shared by the SDK (``client/fn.py``) and the server's fn routes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .models import DEFAULT_MAX_OUTPUT, _Model, _Request

Language = Literal["python", "bash", "c", "cpp"]
DEFAULT_IMAGE = "python-3.11"


class RunCodeRequest(_Request):
    language: Language
    code: str
    stdin: str = ""
    image: str = DEFAULT_IMAGE
    timeout_s: float = Field(10.0, gt=0, le=3600, description="wall time of the run (a compile gets 30 s more)")
    max_output_bytes: int = Field(DEFAULT_MAX_OUTPUT, ge=0, le=1 << 30, description="cap per stream")


class CodeResult(_Model):
    """What a program did. ``timed_out`` is a verdict here (the program was killed at its
    time limit), not an exception: OJ-style checks grade it like any other outcome."""

    exit_code: int
    signal: int = 0
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_ms: int = 0
    compile_exit_code: int | None = Field(None, description="None for interpreted languages")
    compile_stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def compile_error(self) -> bool:
        return self.compile_exit_code not in (None, 0)
