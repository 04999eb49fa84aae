"""A running stage's progress bar in the Prefect UI.

The terminal shows a rich progress bar per stage (``openlab run``); a person watching the flow
run in the UI had only log lines. Each stage's task now carries a Prefect *progress artifact*
(the bar on the task run's Artifacts tab, and on the Artifacts page under ``progress-<stage>``)
fed from the same ``step N/M`` lines of the job's log that drive the terminal's bar
(:data:`orchestrator.pipeline.execute.PipelineHooks.on_progress`). A resumed attempt (after a
preemption or a retry) reports steps from its checkpoint on, so the bar goes on from there.

Updates are throttled: a job may print a step line many times a second, and each update is a
request to the API. A failed update is dropped: a progress bar must not fail a stage.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: An update is sent when the bar moved by at least this many percent ...
MIN_STEP_PERCENT = 1.0
#: ... or this many seconds passed since the last one.
MIN_INTERVAL_SECONDS = 5.0


class StageProgress:
    """One stage's progress artifact, created on the stage's task run at its first step line."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        # Captured in the stage's task: the artifact belongs to that task run, and the log pump
        # thread that reports steps has no Prefect context of its own.
        self._context = contextvars.copy_context()
        self._lock = threading.Lock()
        self.artifact_id: Any = None
        self.percent: float | None = None
        self._sent_at = 0.0

    def update(self, done: int, total: int) -> None:
        """Step ``done`` of ``total``: create or move the bar (throttled)."""
        if total <= 0:
            return
        percent = max(0.0, min(100.0, 100.0 * done / total))
        with self._lock:
            if self.percent is not None and percent < 100.0:
                moved = abs(percent - self.percent) >= MIN_STEP_PERCENT
                if not moved and time.monotonic() - self._sent_at < MIN_INTERVAL_SECONDS:
                    return
            self._send(percent)

    def finish(self) -> None:
        """The stage completed: a bar that was shown ends full."""
        with self._lock:
            if self.artifact_id is not None and self.percent != 100.0:
                self._send(100.0)

    def _send(self, percent: float) -> None:
        try:
            self._context.copy().run(self._create_or_update, percent)
        except Exception as exc:  # noqa: BLE001 - a progress bar must not fail a stage
            log.debug("could not update the progress of %s: %s", self.stage, exc)
            return
        self.percent, self._sent_at = percent, time.monotonic()

    def _create_or_update(self, percent: float) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(
                percent, key=f"progress-{self.stage}", description=f"openlab: steps done of stage {self.stage}"
            )
        else:
            update_progress_artifact(self.artifact_id, percent)


__all__ = ["StageProgress"]
