"""Keep what one stage attempt logged, so `bonsai logs JOB` can show it after the fact.

While an attempt runs, `AttemptLog` collects the ``pipeline.*`` records of the thread running
it (INFO and up, whatever the console shows), one line each; the text goes on the attempt's row.
A long log keeps its last lines and says how many came before.

Example::

    with AttemptLog() as captured:
        module.run(params, inputs, workdir)
    run.log_text = captured.text()
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from datetime import UTC, datetime
from types import TracebackType

__all__ = ["AttemptLog", "MAX_LINES", "MAX_LINE_CHARS"]

MAX_LINES = 400
MAX_LINE_CHARS = 1000
_LOGGER = "pipeline"


class _Collector(logging.Handler):
    def __init__(self, thread_id: int) -> None:
        super().__init__(logging.INFO)
        self.thread_id = thread_id
        self.lines: deque[str] = deque(maxlen=MAX_LINES)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != self.thread_id:
            return  # another attempt's thread (embedded mode runs several), or the heartbeat
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not fail the attempt
            message = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            message += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
        at = datetime.fromtimestamp(record.created, UTC).strftime("%H:%M:%S")
        line = f"{at} {record.levelname} {record.name}: {message}".replace("\n", " | ")
        self.lines.append(line[:MAX_LINE_CHARS])
        self.count += 1


class AttemptLog:
    """Context manager collecting this thread's ``pipeline.*`` log records; `text()` after."""

    def __init__(self) -> None:
        self._collector = _Collector(threading.get_ident())

    def __enter__(self) -> AttemptLog:
        logger = logging.getLogger(_LOGGER)
        if logger.getEffectiveLevel() > logging.INFO:
            # Records below the logger's level are never made. Console handlers keep their own
            # level (the CLI sets it), so INFO reaches only this collector.
            logger.setLevel(logging.INFO)
        logger.addHandler(self._collector)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        logging.getLogger(_LOGGER).removeHandler(self._collector)

    def text(self) -> str:
        """The collected lines, oldest first; '' when nothing was logged."""
        lines = list(self._collector.lines)
        dropped = self._collector.count - len(lines)
        if dropped > 0:
            lines.insert(0, f"… {dropped} earlier line(s) not kept")
        return "\n".join(lines)
