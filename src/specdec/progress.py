"""Progress bars for long work (regenerate, capture, train, evaluate): count, rate, elapsed and ETA
on a terminal; on a log file or CI, where rich draws the bar only when it ends, also one plain line
per running task every 30 seconds."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)


class LoggedProgress(Progress):
    def __init__(self, *columns, every: float = 30.0, **kwargs):
        super().__init__(*columns, **kwargs)
        self.every = every
        self._last_line = time.monotonic()

    def update(self, task_id: TaskID, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._maybe_log()

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._maybe_log()

    def _maybe_log(self) -> None:
        if self.disable or self.console.is_terminal or time.monotonic() - self._last_line < self.every:
            return
        self._last_line = time.monotonic()
        for t in self.tasks:
            if t.finished or not t.started:
                continue
            stats = " ".join(str(v) for v in t.fields.values() if v)
            eta = f", ETA {t.time_remaining:.0f} s" if t.time_remaining is not None else ""
            total = f"/{t.total:,.0f}" if t.total is not None else ""
            self.console.print(f"{t.description} {t.completed:,.0f}{total} {stats} ({t.elapsed or 0:.0f} s{eta})",
                               markup=False, highlight=False)


def progress_bar(stats_field: str = "rate", *, enabled: bool = True, label: str | None = None,
                 console: Console | None = None) -> LoggedProgress:
    """The bar every long stage uses; `stats_field` names the task field shown after the count."""
    return LoggedProgress(
        TextColumn(label if label else "[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn(f"{{task.fields[{stats_field}]}}"), TimeElapsedColumn(), TextColumn("ETA"),
        TimeRemainingColumn(), console=console or Console(stderr=True), disable=not enabled, transient=False,
    )
