"""The library's warnings reach the flow run's log in Prefect, from the stage's task and from
helper threads, and only while the flow runs."""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

import pytest

from orchestrator.prefect_server import PrefectServer
from tests.flows.conftest import flow_run_logs
from tests.flows.one_stage import run_one_stage_flow

pytestmark = [pytest.mark.prefect]

#: A stage whose metrics file is not JSON: the library warns "unreadable metrics" and carries on.
BAD_METRICS = (
    "import pathlib, sys; out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True);"
    "(out / 'metrics.json').write_text('{{not json'); print('wrote a broken metrics file')"
)


def test_a_library_warning_in_a_stage_reaches_that_stage_in_the_ui(
    prefect_server: PrefectServer, openlab_home: Path
) -> None:
    state = run_one_stage_flow("broken", BAD_METRICS)
    assert state.is_completed(), state.message
    logs = flow_run_logs(state.state_details.flow_run_id, "unreadable metrics")
    (warning,) = [log for log in logs if "unreadable metrics" in log.message]
    assert warning.name == "openlab.pipeline" and warning.level == logging.WARNING
    assert warning.task_run_id is not None, "the line sits under the stage's task, where the stage is looked at"
    assert sum("unreadable metrics" in log.message for log in logs) == 1, "sent once"


def test_helper_thread_warnings_are_sent_and_nothing_outside_the_run(
    prefect_server: PrefectServer, openlab_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's log pump and the lease heartbeat log from threads without Prefect's context;
    INFO lines stay out (the flows log their own); after the flow nothing more is attached; a
    secret a message quotes is masked before it reaches the server."""
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_not-a-real-token-0123456789")
    from prefect import flow

    from flows.logs import LIBRARY_LOGGERS, library_logs_to_run

    def heartbeat() -> None:
        logging.getLogger("orchestrator.lineage.leases").warning("lease heartbeat failed: marker-thread")

    @flow(name="library-logs")
    def library_logs() -> None:
        with library_logs_to_run():
            logging.getLogger("orchestrator.links.wandb").warning("W&B mismatch: marker-main")
            logging.getLogger("orchestrator.links.github").warning(
                "GET %s failed", "https://ghp_not-a-real-token-0123456789@x/"
            )
            logging.getLogger("openlab.pipeline").info("pipeline started: marker-info")
            helper = threading.Thread(target=heartbeat)
            helper.start()
            helper.join()
            with library_logs_to_run():  # nested: still one handler
                logging.getLogger("openlab.pipeline").error("marker-nested")

    state = library_logs(return_state=True)
    assert state.is_completed(), state.message
    logging.getLogger("orchestrator.anything").warning("after the flow: marker-after")
    logs = flow_run_logs(state.state_details.flow_run_id, "marker-nested")
    messages = [log.message for log in logs]
    assert any("marker-main" in m for m in messages)
    assert "GET https://***@x/ failed" in messages and not any("ghp_not" in m for m in messages), messages
    assert any("lease heartbeat failed: marker-thread" in m for m in messages), messages
    assert sum("marker-nested" in m for m in messages) == 1
    assert not any("marker-info" in m or "marker-after" in m for m in messages), messages
    for name in LIBRARY_LOGGERS:
        assert not logging.getLogger(name).handlers, "the handler is removed when the flow ends"


def test_a_custom_flow_on_run_stages_as_tasks_shows_its_stages_like_the_replica_flows(
    prefect_server: PrefectServer, openlab_home: Path
) -> None:
    """A lab's own flow (start a pipeline, `run_stages_as_tasks`) passes no hooks: its stage task still
    carries the job's log lines and the stage's transitions, as the replica flows' tasks do."""
    state = run_one_stage_flow("custom", BAD_METRICS)
    assert state.is_completed(), state.message
    logs = flow_run_logs(state.state_details.flow_run_id, "custom COMPLETED")
    in_task = [log.message for log in logs if log.task_run_id is not None]
    assert "[custom] wrote a broken metrics file" in in_task, in_task
    assert any(m.startswith("custom RUNNING") for m in in_task) and any(
        m.startswith("custom COMPLETED") for m in in_task
    ), in_task
    # the end says how long it took and which job did it; why it ran is not read as why it completed
    done = next(m for m in in_task if m.startswith("custom COMPLETED"))
    here = re.escape(os.uname().nodename)  # which job on which cluster: a local job's is this host
    assert re.fullmatch(rf"custom COMPLETED in \d+\.\d s, job local-\w+ on {here} \(it ran because: .+\)", done), done
