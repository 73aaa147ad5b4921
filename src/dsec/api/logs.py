"""Server logging: the default human-readable text, or one JSON object per line
(``dsec serve --log-format json``) for log shippers: ``ts``, ``level``, ``logger``,
``message``, any ``extra`` fields, and ``exception`` with the traceback."""

from __future__ import annotations

import json
import logging
import sys

FORMATS = ("text", "json")
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                 "logger": record.name, "message": record.getMessage()}
        entry.update({k: v for k, v in vars(record).items()
                      if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(log_format: str) -> None:
    """JSON: every record of every logger (dsec's at INFO, uvicorn's warnings) as JSON lines
    on stderr. Text: Python's defaults (warnings and errors), as before."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, not {log_format!r}")
    if log_format == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(logging.WARNING)
        logging.getLogger("dsec").setLevel(logging.INFO)
