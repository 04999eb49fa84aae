"""Served deployments against a real Prefect server: runs from the API, the nightly verdict, cancellation."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
from pytest_httpserver import HTTPServer

from orchestrator.lineage import Attempt, Commit, LineageStore, PipelineRun, StageRun
from orchestrator.lineage.models import GithubUpdate
from orchestrator.provenance.invocation import current_user
from tests.flows.conftest import (
    Served,
    flow_run_logs,
    openlab_events,
    require_service,
    sweep_runs_and_table,
    wait_flow_run,
)
from tests.links.links_fakes import TOKEN, FakeGitHub

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

TINY = {"recipe": "marin-535b-a23b", "replica": "tiny", "backend": "local"}
STAGES = ["data", "tokenize", "pretrain", "midtrain", "posttrain", "eval"]


def start_run(name: str, parameters: dict[str, Any]) -> Any:
    """Create a flow run of deployment ``name`` (as the UI's Run button does) and return its id."""
    from prefect.deployments import run_deployment

    run = run_deployment(name, parameters=parameters, timeout=0)
    return run.id


def test_replica_deployment_runs_tiny_then_reuses(served: Served) -> None:
    """Tiny replica via the served deployment: six stage tasks, job logs and lineage cards in Prefect,
    lineage in the store; a second run reuses every stage."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )
    from prefect.client.schemas.sorting import LogSort

    started = time.monotonic()
    first = wait_flow_run(start_run("replica-pipeline/replica", TINY), 480)
    first_seconds = time.monotonic() - started
    assert first.state.is_completed(), f"{first.state.message}\n{served.log()[-3000:]}"
    assert first.name == "marin-535b-a23b:tiny on local", "the UI's run list says what ran, not two random words"
    with LineageStore(served.db_url) as store:
        (run,) = store.list(PipelineRun, flow_run_id=str(first.id))
        assert run.state == "COMPLETED" and run.trigger == "ui" and run.replica == "tiny"
        assert run.params["prefect"]["backend"] == "local"
        # who: the account serving the flows (Prefect's open-source server knows no user); no command was typed
        assert (run.user, run.command) == (current_user(), None)
        stages = {s.stage: s for s in store.list(StageRun, pipeline_run_id=run.id)}
        assert sorted(stages) == sorted(STAGES) and {s.state for s in stages.values()} == {"COMPLETED"}
        assert stages["eval"].metrics, "eval recorded its metrics"
        # the tiny replica's pre-registered eval loss, checked at the end of the flow run
        (check,) = run.preregistration["checks"]
        assert check["metric"] == "eval/code/loss" and check["actual"] == stages["eval"].metrics["eval/code/loss"]
        for srun in stages.values():
            (attempt,) = store.list(Attempt, stage_run_id=srun.id)
            assert attempt.state == "COMPLETED" and attempt.job_id

    with get_client(sync_client=True) as client:
        by_run = TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[first.id]))
        tasks = client.read_task_runs(task_run_filter=by_run)
        assert sorted(t.name.rsplit("-", 1)[0] for t in tasks) == sorted(STAGES)
        of_run = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[first.id]))
        artifacts = {a.key: a for a in client.read_artifacts(artifact_filter=of_run)}
        assert {f"lineage-{s}" for s in STAGES} | {"lineage-pipeline"} <= set(artifacts)
        assert stages["pretrain"].id in str(artifacts["lineage-pretrain"].data)
        # each training stage's progress bar, on its own task run, fed by the job's step lines and full at the end
        for stage in ("pretrain", "midtrain", "posttrain"):
            bar = artifacts[f"progress-{stage}"]
            (task,) = [t for t in tasks if t.id == bar.task_run_id]
            assert bar.type == "progress" and float(bar.data) == 100.0 and task.name.startswith(stage)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[first.id])), limit=200)
        text = "\n".join(log.message for log in logs)
        assert "[pretrain]" in text, "job log lines reached Prefect's run logs"
        assert "pretrain COMPLETED" in text, "stage transitions reached Prefect's run logs"
        deadline = time.monotonic() + 20  # the flow's last lines reach the server in its final batch
        while "pre-registered eval/code/loss (eval): predicted 5.3" not in text and time.monotonic() < deadline:
            time.sleep(0.5)
            logs = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[first.id])),
                limit=200,
                sort=LogSort.TIMESTAMP_DESC,  # the newest: the outcome is among the last lines
            )
            text = "\n".join(log.message for log in logs)
        assert "pre-registered eval/code/loss (eval): predicted 5.3" in text, "the outcome is in the flow run's log"
    # ... and an event an Automation can trigger on, as is the end of the run
    found = openlab_events(first.id, {"openlab.pipeline-run.completed"})
    (prediction,) = [e for name, e in found.items() if name.startswith("openlab.prediction.")]
    assert prediction.event == f"openlab.prediction.{check['outcome']}"
    assert prediction.payload["metric"] == "eval/code/loss"
    assert found["openlab.pipeline-run.completed"].payload["stages"] == {s: "COMPLETED" for s in STAGES}

    started = time.monotonic()
    again = wait_flow_run(start_run("replica-pipeline/replica", TINY), 120)
    again_seconds = time.monotonic() - started
    assert again.state.is_completed(), again.state.message
    with LineageStore(served.db_url) as store:
        (run,) = store.list(PipelineRun, flow_run_id=str(again.id))
        assert [s.state for s in store.list(StageRun, pipeline_run_id=run.id)] == ["REUSED"] * 6
        (before,) = store.list(PipelineRun, flow_run_id=str(first.id))
    # the run's log ends with the command that compares it with the run before
    hint = (
        f"compared with the previous run: `openlab lineage diff {before.id} {run.id} -m 'eval/*' -m moe/drop_fraction`"
    )
    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + 20
        while True:
            of_again = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[again.id]))
            text = "\n".join(log.message for log in client.read_logs(log_filter=of_again, limit=200))
            if hint in text or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert hint in text, text[-3000:]
    # each reuse said once, with the stage run it reused and why (its task's log said it twice)
    for stage in STAGES:
        said = [line for line in text.splitlines() if line.startswith(f"{stage} ") and "already completed by" in line]
        assert len(said) == 1 and said[0].startswith(f"{stage} REUSED: identity "), (stage, said)
    print(f"tiny replica via deployment: first {first_seconds:.0f}s, all reused {again_seconds:.0f}s")


def test_a_run_an_automation_starts_is_recorded_as_the_automations(served: Served) -> None:
    """A Prefect Automation whose action runs the deployment, fired by a real event: the pipeline
    run's trigger is ``automation`` and it names the Automation, where it used to read ``ui``."""
    from prefect import get_client
    from prefect.automations import Automation
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.events import emit_event
    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import EventTrigger, Posture

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("replica-pipeline/replica")
    name = "re-run the tiny data stage on request"
    automation = Automation(
        name=name,
        trigger=EventTrigger(expect={"test.openlab.rerun-requested"}, posture=Posture.Reactive, threshold=1),
        actions=[RunDeployment(source="selected", deployment_id=deployment.id, parameters={**TINY, "until": "data"})],
    ).create()

    def made_by_automation() -> list[Any]:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
            )
        return [r for r in runs if r.created_by is not None and r.created_by.type == "AUTOMATION"]

    try:
        deadline = time.monotonic() + 90
        emitted = 0.0
        while not (created := made_by_automation()):
            assert time.monotonic() < deadline, "the Automation never created a flow run"
            if time.monotonic() - emitted > 15:  # the triggers service may not have loaded it yet: ask again
                emit_event(event="test.openlab.rerun-requested", resource={"prefect.resource.id": "test.openlab"})
                emitted = time.monotonic()
            time.sleep(1)
    finally:
        automation.delete()  # no more runs from it, whatever happened
    time.sleep(2)  # an event asked again may have fired it twice: each such run ends before the next test
    for flow_run in made_by_automation():
        done = wait_flow_run(flow_run.id, 300)
        assert done.state.is_completed(), f"{done.state.message}\n{served.log()[-3000:]}"
    created = created[0]
    assert wait_flow_run(created.id, 10).name == "marin-535b-a23b:tiny on local until data"
    with LineageStore(served.db_url) as store:
        (run,) = store.list(PipelineRun, flow_run_id=str(created.id))
    assert (run.trigger, run.params["prefect"]["automation"], run.command) == ("automation", name, None)
    assert run.user == current_user()


def test_values_set_in_the_run_form_configure_the_run_and_are_recorded_and_named(served: Served) -> None:
    """The form's `overrides` (`openlab run --set` from the UI): the stage gets the value, the pipeline
    run records it apart from the recipe's own, the flow run's name says it, and a misspelt key
    fails the flow run in one line naming it, before any stage."""
    overrides = {"data.max_bytes_per_domain": 150000}
    done = wait_flow_run(start_run("replica-pipeline/replica", {**TINY, "until": "data", "overrides": overrides}), 180)
    assert done.state.is_completed(), f"{done.state.message}\n{served.log()[-3000:]}"
    assert done.name == "marin-535b-a23b:tiny on local until data data.max_bytes_per_domain=150000"
    with LineageStore(served.db_url) as store:
        (run,) = store.list(PipelineRun, flow_run_id=str(done.id))
        assert run.params["recipe"]["run_set"] == overrides and run.params["prefect"]["overrides"] == overrides
        (data,) = store.list(StageRun, pipeline_run_id=run.id)
        assert data.identity_fields["config"]["data"]["max_bytes_per_domain"] == 150000

    bad = wait_flow_run(
        start_run("replica-pipeline/replica", {**TINY, "until": "data", "overrides": {"data.max_bytes": 1}}), 120
    )
    assert bad.state.is_failed(), bad.state
    assert "overrides data.max_bytes: no such recipe field; did you mean 'data.max_bytes_per_domain'?" in (
        bad.state.message or ""
    ), bad.state.message
    with LineageStore(served.db_url) as store:
        assert store.list(PipelineRun, flow_run_id=str(bad.id)) == []  # refused before anything was recorded


def test_a_sweep_from_the_ui_runs_each_combination_as_a_pipeline_run_and_compares_them(served: Served) -> None:
    """`replica-sweep/sweep`: one replica-pipeline flow run per value of the grid, each under the sweep
    in the UI and recorded with what it set; the `sweep` artifact puts them side by side with what
    each measured. A grid with a key that is no recipe field starts nothing."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    params = {
        **TINY,
        "until": "data",
        "grid": {"data.max_bytes_per_domain": [150000, 120000]},
        "metrics": ["data:data/code/train_bytes"],
        "issue": "lab/sweeps#1",  # the experiment issue every run of the sweep is linked to
    }
    sweep = wait_flow_run(start_run("replica-sweep/sweep", params), 240)
    assert sweep.state.is_completed(), f"{sweep.state.message}\n{served.log()[-3000:]}"
    assert sweep.name == "sweep marin-535b-a23b:tiny on local: data.max_bytes_per_domain x2"
    children, table = sweep_runs_and_table(sweep.id)
    assert sorted(c.name for c in children) == [
        "marin-535b-a23b:tiny on local until data data.max_bytes_per_domain=120000",
        "marin-535b-a23b:tiny on local until data data.max_bytes_per_domain=150000",
    ]
    # the sweep's log names each run as the run list shows it (a search for that name finds it)
    logged = "\n".join(log.message for log in flow_run_logs(sweep.id, "run 2 of 2:"))
    for child in children:
        assert f"(flow run {child.name!r}, id {child.id})" in logged, logged
    assert all(c.state.is_completed() for c in children)
    with LineageStore(served.db_url) as store:
        runs = {str(c.id): store.list(PipelineRun, flow_run_id=str(c.id))[0] for c in children}
    by_value = {r.params["recipe"]["run_set"]["data.max_bytes_per_domain"]: r for r in runs.values()}
    assert set(by_value) == {150000, 120000}
    (sweep_id,) = {r.sweep.get("id") for r in runs.values()}  # each run records which sweep, and which run, it is
    assert sweep_id.startswith("swp_") and all(f"sweep:{sweep_id}" in c.tags for c in children)  # a UI filter
    assert sorted((r.sweep["id"], r.sweep["run"], r.sweep["of"]) for r in runs.values()) == [
        (sweep_id, 1, 2),
        (sweep_id, 2, 2),
    ]
    assert by_value[150000].sweep["run"] == 1  # the grid's order
    assert {r.params["issue"] for r in runs.values()} == {"lab/sweeps#1"}
    assert "| run | state | set.data.max_bytes_per_domain | data/code/train_bytes |" in table, table
    for value, run in by_value.items():  # each run's row: what it set, what its data stage measured
        (row,) = [line for line in table.splitlines() if line.startswith("| ") and run.id in line]
        assert row.split("|")[3].strip() == str(value), row
        assert 0 < int(row.split("|")[4]) < value, row
    (again,) = [line for line in table.splitlines() if "openlab lineage compare" in line]  # how to see it again
    assert f"openlab lineage compare --sweep {sweep_id} -m data:data/code/train_bytes" in again, again
    assert all("sampled" not in r.sweep for r in runs.values())  # a grid: nothing drawn

    # values drawn in the form: each run records how (`params.sweep.sampled`), as `openlab sweep --sample` does,
    # enough to draw the same values again (here a draw of the grid's first value: its data stage is reused)
    how = {"samples": {"data.max_bytes_per_domain": "choice(150000)"}, "count": 1, "seed": 7}
    drawn_sweep = {**params, "grid": None, "samples": how["samples"], "count": 1, "sample_seed": 7}
    drawn_run = wait_flow_run(start_run("replica-sweep/sweep", drawn_sweep), 240)
    assert drawn_run.state.is_completed(), f"{drawn_run.state.message}\n{served.log()[-3000:]}"
    (child,), _ = sweep_runs_and_table(drawn_run.id)
    with LineageStore(served.db_url) as store:
        (recorded,) = store.list(PipelineRun, flow_run_id=str(child.id))
    assert recorded.sweep["sampled"] == how, recorded.sweep
    assert recorded.params["recipe"]["run_set"]["data.max_bytes_per_domain"] == 150000

    # a dry run from the form: per run and stage what it would do, as an artifact; no run started
    dry = {**params, "until": "tokenize", "grid": {"data.max_bytes_per_domain": [150000, 130000]}, "dry_run": True}
    planned = wait_flow_run(start_run("replica-sweep/sweep", dry), 120)
    assert planned.state.is_completed(), planned.state.message
    assert planned.name.endswith("(dry run)"), planned.name
    started, plan = sweep_runs_and_table(planned.id, "sweep-plan")
    assert started == []  # no run
    assert "| 1. `` data.max_bytes_per_domain=150000 `` | reuse | run |" in plan, plan
    assert "| 2. `` data.max_bytes_per_domain=130000 `` | run | run |" in plan, plan
    assert "It would start 3 jobs: data 1, tokenize 2." in plan, plan
    # random search from the form: samples drawn count times, no grid
    drawn = {**dry, "grid": None, "samples": {"data.max_bytes_per_domain": "int(100000, 150000)"}, "count": 2}
    sampled = wait_flow_run(start_run("replica-sweep/sweep", drawn), 120)
    assert sampled.state.is_completed(), sampled.state.message
    assert sampled.name == "sweep marin-535b-a23b:tiny on local: data.max_bytes_per_domain x2 drawn (dry run)"
    _, plan = sweep_runs_and_table(sampled.id, "sweep-plan")
    assert plan.count("| 1. `` data.max_bytes_per_domain=1") == 1 and "| 2. `` data.max_bytes_per_domain=1" in plan

    bad = wait_flow_run(start_run("replica-sweep/sweep", {**params, "grid": {"data.max_bytes": [1, 2]}}), 120)
    assert bad.state.is_failed() and "grid data.max_bytes: no such recipe field" in (bad.state.message or "")
    badly_drawn = wait_flow_run(start_run("replica-sweep/sweep", {**drawn, "samples": {"seed": "normal(0, 1)"}}), 120)
    assert badly_drawn.state.is_failed() and "samples seed: did you mean" in (badly_drawn.state.message or "")
    with get_client(sync_client=True) as client:
        started = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[bad.id]))
        )
    assert started == []  # checked before any run starts


def test_cancelling_a_sweep_cancels_its_runs_and_their_jobs(served: Served) -> None:
    """A sweep cancelled from the UI stops its runs at once (its on-cancellation hook), not when the
    server's cleanup gets to them: each run is Cancelled, its pipeline run CANCELLED, no job left."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Cancelling

    params = {**TINY, "grid": {"pretrain.lr": [0.013, 0.017]}}  # values no other test trains: nothing to reuse
    sweep_id = start_run("replica-sweep/sweep", params)
    children_of = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[sweep_id]))
    deadline = time.monotonic() + 180
    with get_client(sync_client=True) as client:
        while True:  # both runs have started training
            children = client.read_flow_runs(flow_run_filter=children_of)
            if len(children) == 2 and all(c.state.is_running() for c in children):
                break
            assert time.monotonic() < deadline, [(c.name, c.state) for c in children]
            time.sleep(0.5)
        client.set_flow_run_state(sweep_id, Cancelling(message="the grid was wrong"))
    sweep = wait_flow_run(sweep_id, 120)
    assert sweep.state.is_cancelled(), sweep.state
    children = [wait_flow_run(c.id, 120) for c in children]
    assert [c.state.name for c in children] == ["Cancelled", "Cancelled"], [(c.name, c.state) for c in children]
    with LineageStore(served.db_url) as store:
        runs = [store.list(PipelineRun, flow_run_id=str(c.id))[0] for c in children]
        assert [r.state for r in runs] == ["CANCELLED", "CANCELLED"]
        stages = [s for r in runs for s in store.list(StageRun, pipeline_run_id=r.id)]
        assert "RUNNING" not in {s.state for s in stages}, [(s.stage, s.state) for s in stages]
    assert "cancelled sweep run marin-535b-a23b:tiny on local pretrain.lr=0.013" in served.log()


def _plant_better_nightly(store: LineageStore, loss_factor: float) -> PipelineRun:
    """A fake earlier good nightly whose eval losses are ``loss_factor`` times the real tiny ones."""
    real_eval = next(s for s in store.list(StageRun, stage="eval", state="COMPLETED") if s.metrics)
    metrics = {
        k: (v * loss_factor if k.endswith("/loss") and isinstance(v, float) else v)
        for k, v in real_eval.metrics.items()
    }
    with store.transaction() as tx:
        run = tx.add(
            PipelineRun(
                recipe="marin-535b-a23b",
                replica="tiny",
                state="COMPLETED",
                started_at=dt.datetime.now(dt.UTC) - dt.timedelta(days=1),
                verdict={"status": "baseline"},
                backend="local",  # a nightly of the same kind: same backend, same git ref asked
                params={"prefect": {"git_ref": "HEAD"}},
            )
        )
        sha = "0123456789abcdef0123456789abcdef01234567"
        commit = tx.ensure(Commit(id=sha, sha=sha))
        tx.relate("wasAssociatedWith", run, commit, role="code")
        tx.add(StageRun(pipeline_run_id=run.id, stage="eval", identity="planted", state="COMPLETED", metrics=metrics))
    return run


def _verdict_artifact(flow_run_id: Any) -> str:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=["nightly-verdict"])
            )
        )
    return str(artifact.data)


def test_nightly_flow_fails_on_planted_regression_and_records_verdict(served: Served, httpserver: HTTPServer) -> None:
    """The nightly deployment fails naming metric, values and commits when the last good nightly was better."""
    with LineageStore(served.db_url) as store:
        if not store.list(StageRun, stage="eval", state="COMPLETED"):
            first = wait_flow_run(start_run("replica-pipeline/replica", TINY), 480)
            assert first.state.is_completed(), first.state.message
        planted = _plant_better_nightly(store, 0.5)
    params = {"recipe": "marin-535b-a23b", "replica": "tiny", "backend": "local", "git_ref": "HEAD"}
    config = served.home / "openlab.toml"
    defaults = config.read_text()
    config.write_text(defaults + '\n[github]\nrepo = "lab/nightly"\n')  # where regression issues go
    try:
        bad = wait_flow_run(start_run("nightly-replica/nightly", params), 240)
    finally:
        config.write_text(defaults)
    assert bad.state.is_failed()
    assert bad.name == "nightly marin-535b-a23b:tiny on local"  # git_ref HEAD is what runs anyway: not named
    message = bad.state.message or ""
    assert "/loss" in message and "0123456789ab" in message and "regression" in message, message
    verdict_md = _verdict_artifact(bad.id)  # beside the table: what went in differently since the baseline
    assert f"**What went in differently** since `{planted.id}`" in verdict_md, verdict_md
    assert "- **data**: only in this run" in verdict_md and "- **eval**: " in verdict_md, verdict_md
    with LineageStore(served.db_url) as store:
        (run,) = store.list(PipelineRun, flow_run_id=str(bad.id))
        assert run.verdict["status"] == "regressed" and run.verdict["previous_run_id"] == planted.id
        regressed = openlab_events(bad.id, {"openlab.nightly.regressed"})["openlab.nightly.regressed"]
        assert regressed.resource.id == f"openlab.pipeline-run.{run.id}"
        assert any(c["regressed"] and c["metric"].endswith("/loss") for c in regressed.payload["checks"])
        # the regression issue: the runner has no token, so the report waits in the queue for `github sync`
        (queued,) = store.list(GithubUpdate, action="regression", pipeline_run_id=run.id)
        assert queued.issue_id == "lab/nightly" and "no GitHub token" in (queued.last_error or ""), queued
        if "+" not in (run.verdict.get("commit") or ""):  # a clean tree's commit also gets its status
            (status,) = store.list(GithubUpdate, action="status", pipeline_run_id=run.id)
            assert status.issue_id == "lab/nightly", status
        # An unchanged nightly against an equal baseline passes, and is recorded too.
        with store.transaction() as tx:
            tx.update(store.require(PipelineRun, planted.id), verdict={"status": "regressed"})
        _plant_better_nightly(store, 1.0)
    good = wait_flow_run(start_run("nightly-replica/nightly", params), 240)
    assert good.state.is_completed(), good.state.message
    with LineageStore(served.db_url) as store:
        (run,) = store.list(PipelineRun, flow_run_id=str(good.id))
        assert run.verdict["status"] == "passed"
    assert "openlab.nightly.passed" in openlab_events(good.id, {"openlab.nightly.passed"})

    # With a token the runner reports at once: the regression issue is opened on GitHub (the local
    # fake) and its address is in the event an Automation's message links to.
    fake = FakeGitHub(httpserver)
    with LineageStore(served.db_url) as store:
        with store.transaction() as tx:
            tx.update(store.require(PipelineRun, run.id), verdict={"status": "regressed"})
        _plant_better_nightly(store, 0.5)
    config.write_text(
        defaults
        + f'\n[github]\nrepo = "lab/nightly"\nbase_url = "{fake.api}"\ntoken_env = "OPENLAB_TEST_GITHUB_TOKEN"\n'
        "seconds_between_requests = 0\nseconds_between_writes = 0\nmax_wait_s = 5\n"
    )
    try:
        reported = wait_flow_run(start_run("nightly-replica/nightly", params), 240)
    finally:
        config.write_text(defaults)
    assert reported.state.is_failed(), reported.state.message
    (issue,) = fake.issues_in("lab/nightly")
    assert issue["title"].startswith("Nightly regression: marin-535b-a23b/tiny: "), issue["title"]
    assert "openlab:regression" in [label["name"] for label in issue["labels"]] and TOKEN not in issue["body"]
    regressed = openlab_events(reported.id, {"openlab.nightly.regressed"})["openlab.nightly.regressed"]
    assert regressed.payload["regression_issue"] == f"{fake.web}/lab/nightly/issues/1", regressed.payload
    with LineageStore(served.db_url) as store:
        (run,) = store.list(PipelineRun, flow_run_id=str(reported.id))
        assert not store.list(GithubUpdate, action="regression", pipeline_run_id=run.id, state="pending")
    assert TOKEN not in served.log(), "the token never reaches the runner's log"


def _job_alive(served: Served, backend: str, job_id: str) -> bool:
    if backend == "local":
        from orchestrator.launchers import JobHandle, get_launcher
        from orchestrator.settings import load_settings

        settings = load_settings(environ={"OPENLAB_HOME": str(served.home)})
        return not get_launcher("local", settings).status(JobHandle("local", job_id)).state.terminal
    if backend == "docker":
        import docker

        try:
            container = docker.from_env().containers.get(job_id)
        except docker.errors.NotFound:
            return False
        return container.status in ("running", "created", "restarting")
    if backend == "slurm":
        import subprocess

        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
        return out.strip() in ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING")
    raise AssertionError(backend)


def _live_pretrain_job(served: Served, flow_run_id: Any, backend: str, timeout: float = 240) -> Attempt:
    """The running attempt of the flow run's pretrain stage, once its job is alive on ``backend``."""
    deadline = time.monotonic() + timeout
    with LineageStore(served.db_url) as store:
        while True:
            assert time.monotonic() < deadline, f"no pretrain job started:\n{served.log()[-3000:]}"
            runs = store.list(PipelineRun, flow_run_id=str(flow_run_id))
            for srun in store.list(StageRun, pipeline_run_id=runs[0].id, stage="pretrain") if runs else []:
                for att in store.list(Attempt, stage_run_id=srun.id, state="RUNNING"):
                    if att.job_id and _job_alive(served, backend, att.job_id):
                        return att
            time.sleep(0.3)


@pytest.mark.parametrize(
    "backend",
    ["local", pytest.param("docker", marks=pytest.mark.docker), pytest.param("slurm", marks=pytest.mark.slurm)],
)
def test_cancel_through_api_stops_backend_job(served: Served, backend: str) -> None:
    """Cancelling the flow run via the API ends its running job and records CANCELLED in lineage."""
    if backend != "local":
        require_service(backend)
    from prefect import get_client
    from prefect.states import Cancelling

    # `small` shares no outputs with the tiny runs, and its pretrain runs for many minutes, so it is caught
    # mid-job: an earlier stage (data, seconds) could be seen alive and end before the cancel reached it,
    # which failed fresh-clone CI at 7fb976b once (docker).
    params = {"recipe": "marin-535b-a23b", "replica": "small", "backend": backend}
    flow_run_id = start_run("replica-pipeline/replica", params)
    running: Attempt | None = None
    try:
        running = _live_pretrain_job(served, flow_run_id, backend)
        assert _job_alive(served, backend, running.job_id)
    finally:
        # Cancel even when the test failed above: a `small` pretrain left running loads the cores for
        # half an hour and slowed every later test of one CI run until a browser test timed out.
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Cancelling(message="test cancels"), force=True)
    final = wait_flow_run(flow_run_id, 90)
    assert final.state.is_cancelled(), final.state
    deadline = time.monotonic() + 30
    while _job_alive(served, backend, running.job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _job_alive(served, backend, running.job_id), f"{backend} job {running.job_id} still running"
    with LineageStore(served.db_url) as store:
        attempt = store.require(Attempt, running.id)
        assert attempt.state == "CANCELLED", (attempt.state, attempt.reason)
        stage = store.require(StageRun, attempt.stage_run_id)
        assert stage.state == "CANCELLED", (stage.state, stage.error)
        # recorded by the flow process as it stopped (TerminationSignal or the cancel watcher), not left
        # to the on_cancellation hook's safety net, whose reasons start with "cancelled: "
        assert not (attempt.reason or "").startswith("cancelled: "), attempt.reason
        assert not (stage.error or "").startswith("cancelled: "), stage.error
        (run,) = store.list(PipelineRun, flow_run_id=str(flow_run_id))
        assert run.state == "CANCELLED"
        assert not store.list(Attempt, where=[Attempt.stage_run_id == stage.id, Attempt.state == "RUNNING"])
    # the UI shows each stage's task as lineage has it: the cancelled one Cancelled, not Crashed
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    with get_client(sync_client=True) as client:
        of_run = TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id]))
        tasks = {t.name.rsplit("-", 1)[0]: t.state for t in client.read_task_runs(task_run_filter=of_run)}
    assert tasks["pretrain"] is not None and tasks["pretrain"].is_cancelled(), tasks


def _wait_running(flow_run_id: Any, timeout: float) -> None:
    from prefect import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while not (state := client.read_flow_run(flow_run_id).state) or not state.is_running():
            assert time.monotonic() < deadline and not state.is_final(), f"flow run never ran: {state}"
            time.sleep(0.2)


def test_nightly_deployment_runs_the_drop_fraction_reproduction_and_judges_its_arms(served: Served) -> None:
    """The reproduction through the flows, as the UI or a schedule starts it: the nightly deployment on
    the `drops-tiny` replica runs data -> tokenize -> repro as tasks; the first run is the baseline and the
    next one (all reused) passes, comparing each tracked arm's late-window median drop fraction."""
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    params = {"recipe": "marin-535b-a23b", "replica": "drops-tiny", "backend": "local", "git_ref": "HEAD"}
    first_id = start_run("nightly-replica/nightly", params)
    _wait_running(first_id, 120)
    # A nightly due while the last one still runs is cancelled by the deployment's concurrency
    # limit, not queued behind it, and records nothing.
    overlapping = wait_flow_run(start_run("nightly-replica/nightly", params), 120)
    assert overlapping.state.is_cancelled(), overlapping.state
    first = wait_flow_run(first_id, 300)
    assert first.state.is_completed(), f"{first.state.message}\n{served.log()[-3000:]}"
    with get_client(sync_client=True) as client:
        of_run = TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[first.id]))
        tasks = client.read_task_runs(task_run_filter=of_run)
        assert sorted(t.name.rsplit("-", 1)[0] for t in tasks) == ["data", "nightly-verdict", "repro", "tokenize"]
    arms = {"pooled_wave_1.15_1.15", "pooled_wave_1.05_1.33", "waterfilling_cf1.05", "ragged_cf1.15"}
    tracked = {f"repro/{arm}/late_median_drop" for arm in arms}
    with LineageStore(served.db_url) as store:
        assert store.list(PipelineRun, flow_run_id=str(overlapping.id)) == []
        (run,) = store.list(PipelineRun, flow_run_id=str(first.id))
        assert run.state == "COMPLETED" and run.verdict["status"] == "baseline", run.verdict
        assert {c["metric"] for c in run.verdict["checks"]} == tracked
        assert all(c["current"] is not None for c in run.verdict["checks"])
    again = wait_flow_run(start_run("nightly-replica/nightly", params), 180)
    assert again.state.is_completed(), again.state.message
    with LineageStore(served.db_url) as store:
        (run,) = store.list(PipelineRun, flow_run_id=str(again.id))
        assert [s.state for s in store.list(StageRun, pipeline_run_id=run.id)] == ["REUSED"] * 3
        assert run.verdict["status"] == "passed", run.verdict
        assert {c["metric"] for c in run.verdict["checks"]} == tracked
        assert all(c["previous"] == c["current"] for c in run.verdict["checks"])
        # each arm judged against its own noise (the run's standard error of the late-window median)
        assert all(c["noise"] is not None for c in run.verdict["checks"]), run.verdict["checks"]


def test_reconcile_deployment_cancels_the_job_of_a_dead_orchestrator(served: Served) -> None:
    """`lineage-reconcile/reconcile` from the API: a dry run reports and leaves the orphaned job running;
    the real run cancels it, closes stage, attempt and pipeline run, and says so in its log and an artifact."""
    import os

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId

    from orchestrator.launchers import JobSpec, get_launcher
    from orchestrator.launchers.attempts import mark_running, submit_attempt
    from orchestrator.lineage import leases
    from orchestrator.pipeline.reconcile import pipeline_lease_key
    from orchestrator.settings import load_settings

    env = {k: v for k, v in os.environ.items() if k != "OPENLAB_DB_URL"}
    settings = load_settings(environ={**env, "OPENLAB_HOME": str(served.home)})  # where the served flows look
    launcher = get_launcher("local", settings)
    with LineageStore(served.db_url) as store:
        with store.transaction() as tx:
            prun = tx.add(PipelineRun(name="killed", state="RUNNING"))
            srun = tx.add(StageRun(pipeline_run_id=prun.id, stage="pretrain", identity="i-reaped", state="RUNNING"))
        attempt, handle = submit_attempt(
            store, launcher, JobSpec(name="orphan", command=["sleep", "300"]), stage_run_id=srun.id
        )
        mark_running(store, attempt, launcher.status(handle))
        assert leases.acquire(store, "i-reaped", "a-killed-flow", ttl=0.01, stage_run_id=srun.id)
        assert leases.acquire(store, pipeline_lease_key(prun.id), "a-killed-flow", ttl=0.01)
    time.sleep(0.05)
    try:
        dry = wait_flow_run(start_run("lineage-reconcile/reconcile", {"dry_run": True}), 120)
        assert dry.state.is_completed(), (dry.state, served.log()[-3000:])
        assert not launcher.status(handle).state.terminal, "the dry run cancelled the job"
        with LineageStore(served.db_url) as store:
            assert store.require(StageRun, srun.id).state == "RUNNING"

        real = wait_flow_run(start_run("lineage-reconcile/reconcile", {}), 120)
        assert real.state.is_completed(), (real.state, served.log()[-3000:])
        deadline = time.monotonic() + 15
        while not launcher.status(handle).state.terminal:
            assert time.monotonic() < deadline, "the orphaned job still runs after the reconcile flow"
            time.sleep(0.1)
        with LineageStore(served.db_url) as store:
            assert store.require(StageRun, srun.id).state == "CANCELLED"
            assert store.require(Attempt, attempt.id).state == "CANCELLED"
            assert store.require(PipelineRun, prun.id).state == "FAILED"
        said = f"closed stage run {srun.id} (pretrain job {handle.job_id}) as CANCELLED"
        deadline = time.monotonic() + 30  # run logs reach the API in batches, after the state
        with get_client(sync_client=True) as client:
            while True:
                logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[real.id])))
                if any(said in log.message for log in logs):
                    break
                assert time.monotonic() < deadline, [log.message for log in logs]
                time.sleep(0.5)
            (artifact,) = client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[real.id]))
            )
        assert artifact.key == "lineage-reconcile" and srun.id in str(artifact.data)
    finally:
        launcher.cancel(handle)


def test_outputs_gc_deployment_is_a_dry_run_until_told_otherwise(
    served: Served, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`outputs-gc/gc` from the API: by default it only reports (log, artifact); unticking dry_run
    removes the old outputs and marks their artifact records, keeping the last run's."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from orchestrator.lineage import Artifact
    from orchestrator.pipeline import RunOptions, run_pipeline
    from orchestrator.pipeline.outputs import output_dir
    from orchestrator.settings import load_settings
    from tests.pipeline.toy import make_repo, toy_configs, toy_pipeline

    monkeypatch.setenv("OPENLAB_HOME", str(served.home))  # lineage and outputs where the served flows look
    repo = make_repo(tmp_path)
    ids = {}
    for n in (5, 6):
        result = run_pipeline(toy_pipeline(repo), toy_configs(n=n), options=RunOptions(wait_poll=0.05))
        assert result.state == "COMPLETED", result.error
        ids[n] = {stage: r.identity for stage, r in result.results.items()}
    settings = load_settings()
    old = [output_dir(settings, stage, ids[5][stage]) for stage in ("upper", "count")]
    params = {"keep": 1, "unused_for": "0s", "stages": ["upper", "count"]}

    def report(flow_run_id: Any) -> str:
        with get_client(sync_client=True) as client:
            (artifact,) = client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
            )
        assert artifact.key == "outputs-gc"
        return str(artifact.data)

    dry = wait_flow_run(start_run("outputs-gc/gc", params), 120)
    assert dry.state.is_completed(), (dry.state, served.log()[-3000:])
    said = report(dry.id)
    assert "would remove" in said and all(ids[5][s][:16] in said for s in ("upper", "count")), said
    assert all(folder.is_dir() for folder in old), "the default run from the UI deleted something"

    real = wait_flow_run(start_run("outputs-gc/gc", {**params, "dry_run": False}), 120)
    assert real.state.is_completed(), (real.state, served.log()[-3000:])
    said = report(real.id)
    assert said.startswith("**removed") and ids[6]["upper"][:16] not in said, said
    assert not any(folder.exists() for folder in old)
    assert all(output_dir(settings, s, ids[6][s]).is_dir() for s in ("upper", "count")), "the last run's outputs stay"
    with LineageStore(served.db_url) as store:
        gone = [a for a in store.list(Artifact) if a.removed_at is not None and a.uri in {str(f) for f in old}]
    assert len(gone) == 2 and all("openlab gc by" in (a.removed_reason or "") for a in gone)


def test_github_digest_deployment_renders_each_active_issue(served: Served) -> None:
    """`github-digest/daily` from the API, as a dry run (the runner's environment may hold a real token):
    the served flow finds the issue's run in the window and puts the digest it would post in its artifact."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from orchestrator.lineage.models import GithubDigest, GithubUpdate, utcnow
    from tests.links.digest_runs import H, record_run

    now = utcnow()
    with LineageStore(served.db_url) as store:
        record_run(store, "prun_served_digest", "lab/exp#77", started=now - 2 * H, ended=now - H, state="COMPLETED")
    run = wait_flow_run(start_run("github-digest/daily", {"issues": ["lab/exp#77"], "dry_run": True}), 120)
    assert run.state.is_completed(), (run.state, served.log()[-3000:])
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
    said = str(artifact.data)
    assert artifact.key == "github-digest" and "| lab/exp#77 | dry run | `prun_served_digest` |" in said, said
    assert f"<!-- openlab:digest={now:%Y-%m-%d} -->" in said
    with LineageStore(served.db_url) as store:
        assert store.list(GithubDigest) == [] and store.list(GithubUpdate, action="digest") == [], (
            "a dry run records nothing"
        )


def test_a_regressed_nightly_is_accepted_as_the_baseline_from_the_ui(served: Served) -> None:
    """`nightly-accept/accept` from the API, as the UI's Run button: the regressed nightly becomes the
    baseline, who and why on its verdict; a run that cannot be one fails the flow run in one line."""
    from orchestrator.nightly import evaluate_nightly
    from tests.flows.test_nightly_library import TOLERANCES, plant_run

    with LineageStore(served.db_url) as store:
        good = plant_run(store, "a" * 40, 2.0, 0.03, minutes=0)
        evaluate_nightly(store, good.id, TOLERANCES)
        red = plant_run(store, "b" * 40, 2.5, 0.03, minutes=1)
        assert evaluate_nightly(store, red.id, TOLERANCES).status == "regressed"
    refused = wait_flow_run(start_run("nightly-accept/accept", {"pipeline_run_id": good.id, "reason": "x"}), 120)
    assert refused.state.is_failed() and "nothing to accept" in (refused.state.message or ""), refused.state
    run = wait_flow_run(
        start_run("nightly-accept/accept", {"pipeline_run_id": red.id, "reason": "routing changed, lab/exp#51"}), 120
    )
    assert run.state.is_completed(), (run.state, served.log()[-3000:])
    assert run.name == f"accept {red.id} as baseline"
    with LineageStore(served.db_url) as store:
        accepted = store.require(PipelineRun, red.id).verdict["accepted"]
        assert accepted["reason"] == "routing changed, lab/exp#51" and "Prefect flow run" in accepted["by"]
        later = plant_run(store, "c" * 40, 2.5, 0.03, minutes=2)
        assert evaluate_nightly(store, later.id, TOLERANCES).previous_run_id == red.id


def test_a_flow_run_retried_from_the_ui_is_linked_to_the_run_it_retries(served: Served) -> None:
    """A run fails (its data path is missing); the path is fixed and the flow run is retried in place, as
    the UI's Retry button does (AwaitingRetry). The retry's pipeline run names the failed one it retries,
    in its params and as a PROV relation, instead of reading as a new, unrelated run."""
    from prefect import get_client
    from prefect.states import AwaitingRetry

    from orchestrator.lineage.models import Relation
    from orchestrator.pipeline.dag import REPO_ROOT

    corpus = served.home / "retry-corpus"
    recipe = served.home / "retry-recipe.yaml"
    original = (REPO_ROOT / "recipes" / "marin-535b-a23b.yaml").read_text()
    assert '    code: "stdlib:code"' in original
    recipe.write_text(original.replace('    code: "stdlib:code"', f'    code: "path:{corpus}/*.txt"'))
    flow_run_id = start_run(
        "replica-pipeline/replica", {"recipe": str(recipe), "replica": "tiny", "backend": "local", "until": "data"}
    )
    first = wait_flow_run(flow_run_id, 180)
    assert first.state.is_failed(), first.state

    corpus.mkdir()
    for i in range(40):
        (corpus / f"part{i}.txt").write_text(f"def f{i}(x):\n    return x * {i}  # corpus line {i}\n" * 50)
    with get_client(sync_client=True) as client:
        accepted = client.set_flow_run_state(flow_run_id, AwaitingRetry(message="retried from the UI"))
        assert accepted.status.value == "ACCEPT", accepted
    second = wait_flow_run(flow_run_id, 180)
    assert second.state.is_completed(), (second.state, served.log()[-3000:])

    with LineageStore(served.db_url) as store:
        failed, retry = store.list(PipelineRun, flow_run_id=str(flow_run_id), order_by=PipelineRun.started_at)
        assert (failed.state, retry.state) == ("FAILED", "COMPLETED")
        assert retry.params["retry_of"] == failed.id and "retry_of" not in failed.params
        (link,) = store.list(Relation, where=[Relation.subject_id == retry.id, Relation.role == "retry-of"])
        assert (link.relation, link.object_id) == ("wasInformedBy", failed.id)
    from orchestrator.cards import pipeline_card

    with LineageStore(served.db_url) as store:
        assert f"**Retry of:** `{failed.id}`" in pipeline_card(store, retry.id)


def _flow_process(flow_run_id: Any) -> int | None:
    """The pid of the process running ``flow_run_id``: the runner puts the id in its environment,
    and the processes it starts (a local job's supervisor, the job) inherit it, so the flow's is
    the one whose parent lacks it. (Taking the first found killed the job's supervisor once the
    pids had wrapped round below the flow's, and left its job running for the rest of the suite.)"""
    from pathlib import Path

    wanted = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()

    def carries(pid: str) -> bool:
        try:
            return wanted in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False

    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and carries(proc.name):
            try:
                parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
            except (OSError, IndexError):
                continue
            if not carries(parent):
                return int(proc.name)
    return None


def test_a_killed_flow_process_has_its_job_cancelled_by_the_crash_hook(served: Served) -> None:
    """SIGKILL the flow process mid-stage (as the OOM killer would): the runner marks the run Crashed and
    its on_crashed hook cancels the job at once, without waiting for the lease to expire."""
    import os
    import signal

    params = {"recipe": "marin-535b-a23b", "replica": "small", "backend": "local"}
    flow_run_id = start_run("replica-pipeline/replica", params)
    running: Attempt | None = None
    try:
        running = _live_pretrain_job(served, flow_run_id, "local")
        pid = _flow_process(flow_run_id)
        assert pid is not None, "the flow run's process was not found"
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        final = wait_flow_run(flow_run_id, 120)
        assert final.state.is_crashed(), final.state
        while _job_alive(served, "local", running.job_id):
            assert time.monotonic() - killed_at < 60, f"local job {running.job_id} still runs after the crash"
            time.sleep(0.3)
        with LineageStore(served.db_url) as store:
            # the hook records after it cancelled (attempt, stage, then the run): the job can be gone
            # a moment before its record says so, so wait for the run's, the last write, within the bound
            (run,) = store.list(PipelineRun, flow_run_id=str(flow_run_id))
            while run.state == "RUNNING" and time.monotonic() - killed_at < 60:
                time.sleep(0.3)
                run = store.require(PipelineRun, run.id)
            attempt = store.require(Attempt, running.id)
            assert attempt.state == "CANCELLED" and attempt.reason.startswith("crashed: "), attempt.reason
            assert run.state == "FAILED" and run.error.startswith("crashed: "), (run.state, run.error)
    finally:  # a job left running would load the cores for the rest of the suite
        if running is not None and _job_alive(served, "local", running.job_id):
            from orchestrator.launchers import get_launcher
            from orchestrator.launchers.attempts import handle_from_attempt
            from orchestrator.settings import load_settings

            settings = load_settings(environ={"OPENLAB_HOME": str(served.home)})
            get_launcher("local", settings).cancel(handle_from_attempt(running))
