"""The library's own warnings in the flow run's log, where a Prefect UI user looks.

The library logs through the standard ``logging`` module (``orchestrator.*`` and
``openlab.*``), because it knows nothing of Prefect. Inside a flow run those records went
only to the flow process's stderr, so the UI never showed, say, "W&B run X carries stage
identity Y, not Z", "GitHub issue left unresolved", "image_code_check = warn: running
anyway" or "lease heartbeat failed; cancelling our job" - the warnings a person most needs
to see next to the run they are about.

Prefect's ``PREFECT_LOGGING_EXTRA_LOGGERS`` would attach its API handler to these loggers,
but only when set before ``import prefect`` in whatever process runs the flow, and that
handler drops (with a warning of its own) every record logged from a thread that has no run
context: the launcher's log pump and the lease heartbeat are such threads. So
:func:`library_logs_to_run` attaches one handler for the length of a flow run that stamps
each record with the flow run id (and the task run id when the record comes from inside a
task), whatever thread logs it. Records at WARNING and above are sent: the library's INFO
lines ("pipeline run X started") repeat what the flows already log. Secret values (of
variables named like TOKEN, KEY, SECRET, PASSWORD) are masked in every record as it is made
(:func:`orchestrator.secrets.mask_secrets_in_logs`), here and on the process's stderr alike.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from contextlib import contextmanager

#: The library's logger trees (``orchestrator.launchers.attempts``, ``openlab.pipeline``, ...).
LIBRARY_LOGGERS = ("orchestrator", "openlab")
#: Left out: the flows log each stage transition themselves, under the stage's task.
EXCLUDED_LOGGERS = ("openlab.pipeline.transitions",)


class _RunLogHandler(logging.Handler):
    """Prefect's API log handler for records that may come from threads outside any run context."""

    def __init__(self, flow_run_id: str, level: int) -> None:
        from prefect.logging.handlers import APILogHandler

        super().__init__(level)
        self.flow_run_id = flow_run_id
        self._api = APILogHandler()
        # Prefect's settings (the API's address among them) live in context variables, which a
        # new thread does not inherit: a helper thread's record is sent from a copy of the flow's.
        self._flow_context = contextvars.copy_context()

    def emit(self, record: logging.LogRecord) -> None:
        from prefect.context import FlowRunContext, TaskRunContext

        if record.name.startswith(EXCLUDED_LOGGERS):
            return
        # Secret values were masked when the record was made (orchestrator.secrets), before any
        # handler, this one included, could send the line to the server.
        if not getattr(record, "flow_run_id", None):
            record.flow_run_id = self.flow_run_id
            task_ctx = TaskRunContext.get()  # None outside a task and in helper threads
            if task_ctx is not None:
                record.task_run_id = task_ctx.task_run.id
        if FlowRunContext.get() is not None or TaskRunContext.get() is not None:
            self._api.handle(record)
        else:  # a helper thread: its settings (the API's address) are the flow's
            self._flow_context.copy().run(self._api.handle, record)


@contextmanager
def library_logs_to_run(flow_run_id: str | None = None, level: int = logging.WARNING) -> Iterator[None]:
    """Send the library's records at ``level`` and above to flow run ``flow_run_id``'s log (by
    default the flow run this is called in) while the block runs; nothing outside a flow run.

    Nested blocks for the same flow run attach one handler, not two, so no line is sent twice.
    """
    if flow_run_id is None:
        from prefect.context import FlowRunContext

        flow_ctx = FlowRunContext.get()
        flow_run_id = str(flow_ctx.flow_run.id) if flow_ctx is not None and flow_ctx.flow_run else None
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    already = any(isinstance(h, _RunLogHandler) and h.flow_run_id == flow_run_id for lg in loggers for h in lg.handlers)
    if not flow_run_id or already:
        yield
        return
    handler = _RunLogHandler(flow_run_id, level)
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        if lg.getEffectiveLevel() > level:  # a quiet root logger must not swallow the warnings
            lg.setLevel(level)
    try:
        yield
    finally:
        for lg, old in zip(loggers, saved, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(old)
