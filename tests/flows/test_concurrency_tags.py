"""Stage task runs carry tags Prefect's tag concurrency limits count: a limit of one on
``stage:<name>`` makes two pipeline runs' jobs of that stage run one after the other, and a
stage that is only reused takes no backend slot. A real Prefect server enforces the limit."""

from __future__ import annotations

import contextvars
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from orchestrator.prefect_server import PrefectServer
from tests.flows.one_stage import run_one_stage_flow

pytestmark = [pytest.mark.prefect]

#: Appends "start" and "end" lines (with its config's n) around a sleep, to a file named by $SLOTS_LOG.
SLOW = (
    "import json, os, pathlib, sys, time; out = pathlib.Path(sys.argv[1]);"
    "log = open(os.environ['SLOTS_LOG'], 'a');"
    "log.write('start ' + os.environ['OPENLAB_STAGE_RUN'] + '\\n'); log.flush(); time.sleep(4);"
    "log.write('end ' + os.environ['OPENLAB_STAGE_RUN'] + '\\n'); log.close();"
    "(out / 'done.txt').write_text('done')"
)


def _task_run_tags(flow_run_id: Any) -> set[str]:
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    with get_client(sync_client=True) as client:
        of_run = TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id]))
        (task_run,) = client.read_task_runs(task_run_filter=of_run)
        return set(task_run.tags)


def test_a_tag_limit_of_one_runs_two_pipelines_jobs_one_after_the_other(
    prefect_server: PrefectServer, openlab_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect import get_client

    stage = f"slot{uuid.uuid4().hex[:8]}"
    log = tmp_path / "slots.log"
    monkeypatch.setenv("SLOTS_LOG", str(log))
    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag=f"stage:{stage}", concurrency_limit=1)
    try:
        states: dict[int, Any] = {}

        def one(n: int) -> None:
            states[n] = run_one_stage_flow(stage, SLOW, n=n, gpus=1)

        # each thread in a copy of this context: Prefect's settings (the test server's URL) live there
        threads = [threading.Thread(target=contextvars.copy_context().run, args=(one, n)) for n in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert all(s.is_completed() for s in states.values()), {n: s.message for n, s in states.items()}
    finally:
        with get_client(sync_client=True) as client:
            client.delete_concurrency_limit_by_tag(f"stage:{stage}")

    lines = [line.split() for line in log.read_text().splitlines()]
    assert [kind for kind, _ in lines] == ["start", "end", "start", "end"], lines  # never both at once
    assert lines[0][1] == lines[1][1] and lines[2][1] == lines[3][1] != lines[0][1]

    tags = _task_run_tags(states[1].state_details.flow_run_id)
    assert tags == {"openlab", f"stage:{stage}", f"pipeline:{stage}-test", "backend:local", "gpu"}, tags

    # the same identity again is reused: its task run takes no stage, backend or gpu slot
    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag=f"stage:{stage}", concurrency_limit=0)  # would block any job of it
    try:
        again = run_one_stage_flow(stage, SLOW, n=1, gpus=1)
    finally:
        with get_client(sync_client=True) as client:
            client.delete_concurrency_limit_by_tag(f"stage:{stage}")
    assert again.is_completed(), again.message
    assert _task_run_tags(again.state_details.flow_run_id) == {"openlab", "reused", f"pipeline:{stage}-test"}
    assert len(log.read_text().splitlines()) == 4, "reused, not run"
