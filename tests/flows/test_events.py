"""openlab's own Prefect events, which Prefect Automations trigger on, from a real Prefect server."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.lineage import Attempt, LineageStore, StageRun
from orchestrator.prefect_server import PrefectServer
from tests.flows.conftest import openlab_events
from tests.flows.one_stage import run_one_stage_flow

pytestmark = [pytest.mark.prefect]

PREEMPTED_ONCE = (
    "import os, pathlib, signal, sys; out = pathlib.Path(sys.argv[1]); m = out.parent / 'preempted-once';"
    "first = not m.exists(); m.touch(); first and os.kill(os.getpid(), signal.SIGTERM)"
)
ALWAYS_FAILS = "import sys; sys.exit(3)"
#: The first job saves its checkpoint and outlives its 1 s limit; the next finds it and finishes.
SAVES_THEN_OUTLIVES_ITS_LIMIT = (
    "import pathlib, sys, time; out = pathlib.Path(sys.argv[1]); ckpt = out / 'ckpt.json';"
    "first = not ckpt.exists(); ckpt.write_text('1'); first and time.sleep(60)"
)


def test_a_preempted_stage_and_the_end_of_the_run_are_events(prefect_server: PrefectServer, openlab_home: Path) -> None:
    state = run_one_stage_flow("spot", PREEMPTED_ONCE)
    assert state.is_completed(), state.message
    flow_run_id = state.state_details.flow_run_id
    found = openlab_events(flow_run_id, {"openlab.stage.preempted", "openlab.pipeline-run.completed"})
    preempted, done = found["openlab.stage.preempted"], found["openlab.pipeline-run.completed"]
    with LineageStore.open() as store:
        (stage,) = store.list(StageRun)
        assert [a.state for a in store.list(Attempt, stage_run_id=stage.id)] == ["PREEMPTED", "COMPLETED"]
    assert preempted.resource.id == f"openlab.stage-run.{stage.id}" and preempted.payload["stage"] == "spot"
    assert "SIGTERM" in preempted.payload["reason"] and preempted.payload["progress_saved"] is False
    roles = {r.role: r.id for r in preempted.related}
    assert roles["pipeline-run"] == f"openlab.pipeline-run.{stage.pipeline_run_id}"
    assert roles["flow-run"] == f"prefect.flow-run.{flow_run_id}", "Prefect attached the run it came from"
    assert roles["commit"].startswith("openlab.commit.")
    assert done.resource.id == f"openlab.pipeline-run.{stage.pipeline_run_id}"
    assert done.payload["stages"] == {"spot": "COMPLETED"}
    assert "openlab.stage.failed" not in found, "a preemption is not reported as a failure"


def test_a_stage_its_time_limit_stopped_after_saving_is_time_limited_not_preempted(
    prefect_server: PrefectServer, openlab_home: Path
) -> None:
    """One link of a chain of jobs under a wall-time cap is planned: an Automation paging on
    preemptions must not fire on it, so it has its own event, which says the job saved."""
    state = run_one_stage_flow("chained", SAVES_THEN_OUTLIVES_ITS_LIMIT, checkpoint="ckpt.json", time_limit=1)
    assert state.is_completed(), state.message
    found = openlab_events(
        state.state_details.flow_run_id, {"openlab.stage.time-limited", "openlab.pipeline-run.completed"}
    )
    limited = found["openlab.stage.time-limited"]
    assert "time limit exceeded" in limited.payload["reason"] and "going on from it" in limited.payload["reason"]
    assert limited.payload["progress_saved"] is True
    assert "openlab.stage.preempted" not in found and "openlab.stage.failed" not in found, sorted(found)


def test_a_failed_stage_and_run_are_events(prefect_server: PrefectServer, openlab_home: Path) -> None:
    state = run_one_stage_flow("broken", ALWAYS_FAILS)
    assert state.is_failed()
    found = openlab_events(state.state_details.flow_run_id, {"openlab.stage.failed", "openlab.pipeline-run.failed"})
    assert "exit 3" in found["openlab.stage.failed"].payload["reason"]
    assert found["openlab.pipeline-run.failed"].payload["stages"] == {"broken": "FAILED"}


def test_event_payloads_carry_no_secret(
    prefect_server: PrefectServer, openlab_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reason may quote a backend's error text, which may quote a credential; the event, stored by
    the Prefect server, does not: secret values are scrubbed and credential-named entries masked."""
    from prefect import flow

    from flows import events

    monkeypatch.setenv("GITHUB_TOKEN", "ghp_not-a-real-token-0123456789")

    @flow(name="leaky")
    def leaky() -> None:
        payload = {"reason": "GET https://ghp_not-a-real-token-0123456789@github.example failed", "api_key": "k" * 20}
        events.emit("openlab.stage.failed", "stage-run", "srun_leaky", payload=payload)

    state = leaky(return_state=True)
    found = openlab_events(state.state_details.flow_run_id, {"openlab.stage.failed"})
    payload = found["openlab.stage.failed"].payload
    assert payload == {"reason": "GET https://***@github.example failed", "api_key": "***"}, payload
