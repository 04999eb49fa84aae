"""The pipeline library against a scratch git repository: reuse, partial re-runs, leases, reconcile.

Everything runs for real: git, the local launcher (subprocesses), SQLite in a fresh
OPENLAB_HOME (see tests/conftest.py), snapshots. The toy stages are three tiny scripts
(tests/pipeline/toy.py) so the whole file runs in well under a minute.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.lineage import leases
from orchestrator.lineage.listing import RecordFilter, list_records
from orchestrator.lineage.models import Artifact, Attempt, DataSnapshot, PipelineRun, Relation, StageRun
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline import (
    PipelineHooks,
    RunOptions,
    StageCancelled,
    StageTransition,
    execute_stage,
    plan,
    preemption_retries,
    reconcile,
    run_pipeline,
    run_stages,
    stage_retries,
    start_pipeline,
)
from orchestrator.settings import load_settings
from tests.pipeline.toy import git, make_repo, toy_configs, toy_pipeline

HERE = Path(__file__).resolve().parent


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path)


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each real stage execution appends a line here (the jobs inherit the environment)."""
    path = tmp_path / "ledger.txt"
    monkeypatch.setenv("TOY_LEDGER", str(path))
    return path


def executions(ledger: Path) -> list[str]:
    return [line.split()[0] for line in ledger.read_text().splitlines()] if ledger.exists() else []


def fast() -> RunOptions:
    return RunOptions(wait_poll=0.05, lease_ttl=10)


def test_a_copy_of_the_project_without_git_is_refused_in_one_line_before_anything_is_recorded(
    repo: Path, ledger: Path
) -> None:
    """Run from a copy with no ``.git`` (a tarball, a container's copy) or without git installed, the
    capture records no tree ids: ``run``, ``explain`` and ``adopt`` died in a KeyError, and ``run`` had
    recorded its pipeline run as FAILED first."""
    import shutil

    from orchestrator.provenance import ProvenanceWarning
    from orchestrator.provenance.git import ProvenanceError

    shutil.rmtree(repo / ".git")
    with (
        pytest.warns(ProvenanceWarning, match="no git"),
        pytest.raises(
            ProvenanceError,
            match=r"cannot hash the stages' code \(stages/gen.py, .*\) in .*: no git; run from a git clone",
        ),
    ):
        plan(toy_pipeline(repo), toy_configs())
    with pytest.warns(ProvenanceWarning, match="no git"), pytest.raises(ProvenanceError, match="cannot hash the"):
        run_pipeline(toy_pipeline(repo), toy_configs(), options=fast())
    assert executions(ledger) == []
    with LineageStore.open(load_settings()) as store:
        assert store.list(PipelineRun) == [] and store.events() == [], "nothing recorded"


def test_first_run_records_lineage_and_second_run_reuses_every_stage(repo: Path, ledger: Path) -> None:
    transitions: list[tuple[str, str]] = []
    logs: list[tuple[str, str]] = []
    hooks = PipelineHooks(
        on_transition=lambda e: transitions.append((e.stage, e.state)), on_log=lambda s, line: logs.append((s, line))
    )
    first = run_pipeline(toy_pipeline(repo), toy_configs(), options=fast(), hooks=hooks)
    assert first.ok, first.error
    assert [r.state for r in first.results.values()] == ["COMPLETED"] * 3
    assert executions(ledger) == ["gen", "upper", "count"]
    assert ("count", "step 1/1 counting") in logs
    assert ("gen", "RUNNING") in transitions and ("count", "COMPLETED") in transitions

    settings = load_settings()
    with LineageStore.open(settings) as store:
        gen = store.require(StageRun, first.results["gen"].stage_run_id)
        assert gen.outputs["out"]["content_hash"] and gen.metrics["lines"] == 5
        assert gen.outputs["out"]["path"].startswith(str(settings.artifacts_dir / "gen" / gen.identity[:16]))
        art = store.require(Artifact, gen.outputs["out"]["artifact_id"])
        assert art.content_hash == gen.outputs["out"]["content_hash"]
        assert store.get(DataSnapshot, gen.outputs["out"]["snapshot_id"]) is not None  # the corpus is a snapshot
        upper = first.results["upper"].stage_run_id
        rels = {(r.relation, r.subject_id, r.object_kind) for r in store.relations(upper)}
        assert ("used", upper, "artifact") in rels
        assert ("wasAssociatedWith", upper, "commit") in rels
        assert ("wasAssociatedWith", upper, "environment") in rels
        assert any(r.relation == "wasGeneratedBy" and r.object_id == upper for r in store.relations(upper))
        attempts = store.list(Attempt, stage_run_id=upper)
        assert len(attempts) == 1 and attempts[0].state == "COMPLETED" and attempts[0].backend == "local"
        run = store.require(PipelineRun, first.pipeline_run.id)
        assert run.state == "COMPLETED" and run.ended_at is not None

    second = run_pipeline(toy_pipeline(repo), toy_configs(), options=fast())
    assert second.ok
    assert [r.state for r in second.results.values()] == ["REUSED"] * 3
    assert executions(ledger) == ["gen", "upper", "count"]  # nothing executed again
    for name, r in second.results.items():
        assert r.reused_from == first.results[name].stage_run_id
        assert "outputs verified" in r.reason
    with LineageStore.open() as store:
        reused = store.require(StageRun, second.results["count"].stage_run_id)
        assert reused.state == "REUSED" and reused.reused_from == first.results["count"].stage_run_id
        assert reused.outputs == store.require(StageRun, first.results["count"].stage_run_id).outputs


def test_explain_names_the_commits_a_checkout_of_an_older_commit_undoes(repo: Path, ledger: Path) -> None:
    """Run at a commit, then check out the one before it: the stage runs again, and the dry run
    names the commit the previous run had and HEAD lacks (old..HEAD alone lists nothing)."""
    pipeline = toy_pipeline(repo)
    base = git(repo, "rev-parse", "HEAD").strip()
    script = repo / "stages" / "upper.py"
    script.write_text(script.read_text() + "# a comment\n")
    git(repo, "commit", "-qam", "upper: a comment")
    sha = git(repo, "rev-parse", "HEAD").strip()
    assert run_pipeline(pipeline, toy_configs(), options=fast()).ok
    git(repo, "checkout", "-q", base)
    planned = {p.stage: p for p in plan(pipeline, toy_configs())}
    assert planned["upper"].action == "run"
    assert planned["upper"].commits == [f"{sha[:12]} upper: a comment (undone: the previous run had it)"], planned[
        "upper"
    ].commits


def test_one_line_change_reruns_that_stage_and_only_stages_whose_input_changed(repo: Path, ledger: Path) -> None:
    pipeline = toy_pipeline(repo)
    assert run_pipeline(pipeline, toy_configs(), options=fast()).ok
    script = repo / "stages" / "upper.py"

    # 1. a one-line edit that does not change upper's output: upper re-runs, count is reused
    script.write_text(script.read_text() + "# a comment\n")
    git(repo, "commit", "-qam", "upper: a comment")
    (repo / "README").write_text("a commit that touches no stage's code\n")
    git(repo, "commit", "-qam", "readme")
    planned = {p.stage: p for p in plan(pipeline, toy_configs())}
    assert planned["gen"].action == "reuse"
    assert planned["upper"].action == "run"
    assert planned["upper"].changes and all(c.startswith("code.stages/upper.py") for c in planned["upper"].changes)
    # ... and which commits since the last run changed that code: where to look
    sha = git(repo, "rev-parse", "HEAD~1").strip()
    assert planned["upper"].commits == [f"{sha[:12]} upper: a comment"], planned["upper"].commits
    assert planned["count"].action == "depends"
    result = run_pipeline(pipeline, toy_configs(), options=fast())
    assert {k: r.state for k, r in result.results.items()} == {"gen": "REUSED", "upper": "COMPLETED", "count": "REUSED"}
    assert "code.stages/upper.py" in result.results["upper"].reason
    assert executions(ledger)[3:] == ["upper"]

    # 2. a one-line edit that changes upper's output: upper and count re-run, gen does not
    script.write_text(script.read_text().replace("text.upper()", "text.upper() + 'X'"))
    planned = {p.stage: p for p in plan(pipeline, toy_configs())}
    assert planned["upper"].commits == ["uncommitted changes in the working tree"], planned["upper"].commits
    result = run_pipeline(pipeline, toy_configs(), options=fast())
    assert {k: r.state for k, r in result.results.items()} == {
        "gen": "REUSED",
        "upper": "COMPLETED",
        "count": "COMPLETED",
    }
    assert any(c.startswith("inputs.text") for c in result.results["count"].changes)
    assert executions(ledger)[4:] == ["upper", "count"]

    # 3. an edit outside every declared code path changes nothing
    (repo / "README").write_text("edited\n")
    result = run_pipeline(pipeline, toy_configs(), options=fast())
    assert [r.state for r in result.results.values()] == ["REUSED"] * 3


def test_changed_output_on_disk_is_not_reused(repo: Path, ledger: Path) -> None:
    first = run_pipeline(toy_pipeline(repo), toy_configs(), options=fast())
    (first.results["count"].out_dir / "count.json").write_text('{"words": -1}')
    (first.results["count"].out_dir / "partial.bin").write_bytes(b"left by whoever edited it")
    again = run_pipeline(toy_pipeline(repo), toy_configs(), options=fast())
    assert again.results["count"].state == "COMPLETED"
    assert executions(ledger) == ["gen", "upper", "count", "count"]
    # it ran in an empty folder: a training stage finds what it left there and goes on from it
    assert not (again.results["count"].out_dir / "partial.bin").exists()
    # why it ran: its recorded output changed, not "no earlier completed run"
    why = again.results["count"].reason
    count = first.results["count"]
    recorded = f"{count.stage_run_id}: output out at {count.out_dir} changed since it was recorded"
    assert why.startswith("completed runs with this identity no longer verify: ") and why.endswith(recorded), why


def test_an_output_whose_volatile_files_alone_changed_is_reused(repo: Path, ledger: Path) -> None:
    """`openlab wandb sync` marks W&B's run folder synced and a metric may be logged again: what later
    stages read of the output is unchanged, and so it is reused, not run again."""
    first = run_pipeline(toy_pipeline(repo), toy_configs(), options=fast())
    out = first.results["count"].out_dir
    (out / "wandb" / "offline-run-1").mkdir(parents=True)
    (out / "wandb" / "offline-run-1" / "run-1.wandb.synced").write_text("")
    (out / "metrics.json").write_text('{"words": 3, "relogged": 1}')
    for deep in (False, True):
        again = run_pipeline(toy_pipeline(repo), toy_configs(), options=dataclasses.replace(fast(), deep_verify=deep))
        assert [again.results[s].state for s in ("gen", "upper", "count")] == ["REUSED"] * 3, deep
    assert executions(ledger) == ["gen", "upper", "count"]


def test_two_pipeline_processes_at_once_execute_each_identity_once(repo: Path, ledger: Path) -> None:
    start_at = time.time() + 2.0
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "toy.py"), str(repo), "0.4", str(start_at)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted(executions(ledger)) == ["count", "gen", "upper"]  # each identity executed exactly once
    for stage in ("gen", "upper", "count"):
        states = sorted(next(s["state"] for s in r["stages"] if s["stage"] == stage) for r in results)
        assert states == ["COMPLETED", "REUSED"], (stage, states)
    waited = [s for r in results for s in r["stages"] if s["state"] == "REUSED"]
    assert any("waited" in s["reason"] for s in waited)
    with LineageStore.open() as store:
        assert store.list(StageRun, state="RUNNING") == []
        assert [lease for lease in store.list(leases.Lease)] == []


def test_expired_lease_is_taken_over_and_old_holder_cancels_its_job(
    repo: Path, ledger: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = toy_pipeline(repo)
    configs = toy_configs()  # TOY_SLEEP (inherited by the job) makes A's job long, B's short
    # A's lease expires after 0.5 s and A only heartbeats every 3 s: a stalled holder.
    ctx_a = start_pipeline(pipeline, configs, options=RunOptions(lease_ttl=0.5, heartbeat_interval=3.0, wait_poll=0.05))
    ctx_b = start_pipeline(pipeline, configs, options=RunOptions(lease_ttl=10, wait_poll=0.05))
    outcome: dict[str, object] = {}

    def run_a() -> None:
        try:
            outcome["a"] = execute_stage(ctx_a, "gen")
        except StageCancelled as exc:
            outcome["a"] = exc

    monkeypatch.setenv("TOY_SLEEP", "60")
    thread = threading.Thread(target=run_a)
    thread.start()
    deadline = time.time() + 20
    while executions(ledger) != ["gen"] and time.time() < deadline:
        time.sleep(0.05)
    assert executions(ledger) == ["gen"], "A's job did not start"
    monkeypatch.setenv("TOY_SLEEP", "0")
    time.sleep(0.7)  # A's lease has expired by now
    b = execute_stage(ctx_b, "gen")
    assert b.state == "COMPLETED"
    thread.join(timeout=30)
    assert not thread.is_alive()
    a = outcome["a"]
    assert isinstance(a, StageCancelled), a
    assert a.result is not None and a.result.state == "CANCELLED"
    assert "lease" in a.result.reason
    with LineageStore.open() as store:
        srun = store.require(StageRun, a.result.stage_run_id)
        assert srun.state == "CANCELLED"
        (attempt,) = store.list(Attempt, stage_run_id=srun.id)
        assert attempt.state == "CANCELLED"
    # A's job process is gone
    pid = int(ledger.read_text().splitlines()[0].split()[1])
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]


def test_reconcile_closes_stale_running_stage_runs(repo: Path) -> None:
    from orchestrator.launchers.attempts import submit_attempt
    from orchestrator.launchers.base import JobSpec, get_launcher

    settings = load_settings()
    with LineageStore.open(settings) as store:
        with store.transaction() as tx:
            orphan = tx.add(StageRun(stage="gen", identity="i-orphan", state="RUNNING"))
            never = tx.add(StageRun(stage="gen", identity="i-never", state="RUNNING"))
            alive = tx.add(StageRun(stage="gen", identity="i-alive", state="RUNNING"))
        launcher = get_launcher("local", settings)
        _, handle = submit_attempt(
            store, launcher, JobSpec(name="orphan", command=["sleep", "60"]), stage_run_id=orphan.id
        )
        assert leases.acquire(store, "i-alive", "someone", ttl=60, stage_run_id=alive.id)
        assert leases.acquire(store, "i-orphan", "dead-holder", ttl=0.01, stage_run_id=orphan.id)
        time.sleep(0.05)

        done = {r.stage_run_id: r for r in reconcile(store, settings=settings)}
        assert set(done) == {orphan.id, never.id}
        assert done[orphan.id].state == "CANCELLED" and "orphaned" in done[orphan.id].reason
        assert done[never.id].state == "LOST"
        assert store.require(StageRun, orphan.id).state == "CANCELLED"
        assert store.require(StageRun, alive.id).state == "RUNNING"
        status = launcher.wait(handle, timeout=15)
        assert status.state.terminal
        (attempt,) = store.list(Attempt, stage_run_id=orphan.id)
        assert attempt.state in ("CANCELLED", "FAILED")
        assert reconcile(store, settings=settings) == []


def test_reconcile_leaves_a_stage_alone_while_its_backend_cannot_be_asked(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slurmctld failing over while the reaper passed closed the stage run LOST, for good, and the
    job ran on unwatched; the reaper now leaves it for a later pass, when Slurm answers again."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(
        "#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller (connect failure)' >&2\nexit 1\n"
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("OPENLAB_BACKENDS__SLURM__BIN_DIR", str(bin_dir))
    monkeypatch.setenv("OPENLAB_BACKENDS__SLURM__RETRIES", "0")
    settings = load_settings()
    with LineageStore.open(settings) as store:
        with store.transaction() as tx:
            run = tx.add(StageRun(stage="gen", identity="i-down", state="RUNNING"))
            tx.add(Attempt(stage_run_id=run.id, backend="slurm", job_id="4711", state="RUNNING"))
        (done,) = reconcile(store, settings=settings)
        assert done.state == "RUNNING" and "cannot be asked about job 4711 now" in done.reason, done
        assert "Unable to contact slurm controller" in done.reason
        assert store.require(StageRun, run.id).state == "RUNNING"
        assert [a.state for a in store.list(Attempt, stage_run_id=run.id)] == ["RUNNING"]


def test_failed_stage_fails_the_pipeline_and_skips_the_rest(repo: Path, ledger: Path) -> None:
    (repo / "stages" / "upper.py").write_text((repo / "stages" / "upper.py").read_text() + "raise SystemExit(3)\n")
    seen: list[tuple[str, str]] = []
    result = run_pipeline(
        toy_pipeline(repo),
        toy_configs(),
        options=fast(),
        hooks=PipelineHooks(on_transition=lambda e: seen.append((e.stage, e.state))),
    )
    assert result.state == "FAILED"
    assert result.results["upper"].state == "FAILED" and "exit 3" in result.results["upper"].reason
    assert "count" not in result.results and ("count", "SKIPPED") in seen
    with LineageStore.open() as store:
        assert store.require(PipelineRun, result.pipeline_run.id).state == "FAILED"
        assert store.require(StageRun, result.results["upper"].stage_run_id).state == "FAILED"


def _open_handles(path: Path) -> list[str]:
    """This process's open files under `path` (the SQLite database, its WAL and shared memory)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            found.append(target)
    return found


def test_a_backend_named_in_capitals_is_recorded_as_filters_name_it(repo: Path, ledger: Path) -> None:
    """`--backend Local` runs on local and is recorded as `local`, so `lineage list --backend local` finds it."""
    result = run_pipeline(toy_pipeline(repo), toy_configs(), options=dataclasses.replace(fast(), backend="Local"))
    assert result.ok, result.error
    assert result.pipeline_run.backend == "local"
    with LineageStore.open(load_settings()) as store:
        assert [r.id for r in list_records(store, ["pipeline_run"], RecordFilter(backend="local")).records] == [
            result.pipeline_run.id
        ]


def test_a_refused_start_records_nothing_and_leaves_no_database_open(
    repo: Path, openlab_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long-lived process (the Prefect worker, a notebook) that is refused a start keeps no engine."""
    db = openlab_home / "lineage.db"
    with pytest.raises(ConfigError, match="unknown backend 'nope'"):
        start_pipeline(toy_pipeline(repo), toy_configs(), options=RunOptions(backend="nope"))
    with pytest.raises(ConfigError, match="unknown backend 'slurmm'; did you mean 'slurm'"):
        toy = toy_pipeline(repo)
        misspelt = dataclasses.replace(
            toy, stages=(dataclasses.replace(toy.stages[0], backend="slurmm"), *toy.stages[1:])
        )
        start_pipeline(misspelt, toy_configs(), options=fast())
    assert not db.exists()  # refused from its arguments alone, before the store is opened
    monkeypatch.setenv("OPENLAB_BACKENDS__LOCAL__POLL_INTERVAL", "soon")
    with pytest.raises(ConfigError, match=r"\[backends.local\] poll_interval"):
        start_pipeline(toy_pipeline(repo), toy_configs(), options=fast())
    assert db.exists()  # this one was refused by the launcher, after the reconciler read the store
    assert _open_handles(openlab_home) == []
    with LineageStore.open() as store:
        assert store.list(PipelineRun) == []


FLAKY_ONCE = (
    "\nimport os, pathlib\n"
    "_marker = pathlib.Path(os.environ['TOY_FLAKY_MARKER'])\n"
    "if not _marker.exists():\n    _marker.touch()\n    raise SystemExit(3)\n"
)


def test_a_failed_stage_is_retried_as_a_new_attempt_of_the_same_stage_run(
    repo: Path, ledger: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`openlab run` retries like the flows do: a transient failure costs an attempt, not the run."""
    script = repo / "stages" / "upper.py"
    script.write_text(script.read_text() + FLAKY_ONCE)
    monkeypatch.setenv("TOY_FLAKY_MARKER", str(tmp_path / "failed-once"))
    seen: list[tuple[str, str]] = []
    hooks = PipelineHooks(on_transition=lambda e: seen.append((e.stage, e.state)))
    ctx = start_pipeline(toy_pipeline(repo), toy_configs(), options=fast(), hooks=hooks)
    result = run_stages(ctx, retries=1)
    assert result.state == "COMPLETED", result.error
    assert ("upper", "RETRYING") in seen
    with LineageStore.open() as store:
        (upper,) = store.list(StageRun, pipeline_run_id=result.pipeline_run.id, stage="upper")
        attempts = store.list(Attempt, stage_run_id=upper.id, order_by=Attempt.number)
        assert [(a.number, a.state, a.exit_code) for a in attempts] == [(1, "FAILED", 3), (2, "COMPLETED", 0)]
        assert upper.state == "COMPLETED"
    # without a retry the same failure fails the run
    (tmp_path / "failed-once").unlink()
    again = run_pipeline(toy_pipeline(repo), toy_configs(), options=RunOptions(wait_poll=0.05, force=True))
    assert again.state == "FAILED" and again.results["upper"].state == "FAILED"


def test_a_cancelled_stage_is_not_retried(repo: Path, ledger: Path) -> None:
    """Retries are for failures: a stage cancelled by request ends the run CANCELLED, not retried."""
    seen: list[tuple[str, str]] = []
    hooks = PipelineHooks(
        on_transition=lambda e: seen.append((e.stage, e.state)),
        should_cancel=lambda: ("gen", "RUNNING") in seen,  # a cancel while the first job runs
    )
    ctx = start_pipeline(toy_pipeline(repo), toy_configs(), options=fast(), hooks=hooks)
    result = run_stages(ctx, retries=2)
    assert result.state == "CANCELLED", result.error
    assert [s for s in seen if s[1] in ("CANCELLED", "RETRYING")] == [("gen", "CANCELLED")], seen
    with LineageStore.open() as store:
        assert [a.state for a in store.list(Attempt)] == ["CANCELLED"], "one attempt, not three"


#: What openlab's workloads do with a config they refuse (workloads/moe/__main__.py): one `error: config:` line, exit 2.
REFUSES_ITS_CONFIG = (
    "\nimport sys\n"
    "print('error: config: model.context=128 is longer than the data', file=sys.stderr)\nraise SystemExit(2)\n"
)


def test_a_stage_whose_job_refused_its_config_is_not_retried_and_the_log_says_why(
    repo: Path, ledger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`openlab run --retries 2` on a stage whose workload refused its config: one attempt, not three
    identical ones queued for a node each, and one line that says why it was not retried."""
    script = repo / "stages" / "upper.py"
    script.write_text(script.read_text() + REFUSES_ITS_CONFIG)
    seen: list[tuple[str, str]] = []
    hooks = PipelineHooks(on_transition=lambda e: seen.append((e.stage, e.state)))
    ctx = start_pipeline(toy_pipeline(repo), toy_configs(), options=fast(), hooks=hooks)
    with caplog.at_level(logging.WARNING, logger="openlab.pipeline"):
        result = run_stages(ctx, retries=2)
    assert result.state == "FAILED", result.error
    assert ("upper", "RETRYING") not in seen, seen
    with LineageStore.open() as store:
        (upper,) = store.list(StageRun, pipeline_run_id=result.pipeline_run.id, stage="upper")
        attempts = store.list(Attempt, stage_run_id=upper.id)
        assert [(a.state, a.exit_code) for a in attempts] == [("FAILED", 2)], "one attempt, not three"
        assert "error: config: model.context=128" in (attempts[0].reason or "")
    (why,) = [r.getMessage() for r in caplog.records if "not retried" in r.getMessage()]
    assert why.startswith("upper is not retried: its job refused its config (exit 2, error: config: model.context"), why


def test_stage_retries_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert stage_retries(load_settings()) == 1
    monkeypatch.setenv("OPENLAB_PIPELINE__STAGE_RETRIES", "3")
    assert stage_retries(load_settings()) == 3
    monkeypatch.setenv("OPENLAB_PIPELINE__STAGE_RETRIES", "lots")
    with pytest.raises(ConfigError, match=r"invalid \[pipeline\] stage_retries 'lots'"):
        stage_retries(load_settings())


#: Stopped from outside by SIGTERM (as a preemption or an eviction would), the first time only or always.
PREEMPTED = (
    "\nimport os, pathlib, signal\n"
    "_marker = pathlib.Path(os.environ['TOY_PREEMPT_MARKER'])\n"
    "if not _marker.exists() or os.environ.get('TOY_PREEMPT_ALWAYS'):\n"
    "    _marker.touch()\n    os.kill(os.getpid(), signal.SIGTERM)\n"
)


def test_a_preempted_stage_runs_again_without_spending_a_retry(
    repo: Path, ledger: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job stopped by SIGTERM that openlab did not send is not the stage's failure: with no
    retries at all the stage still completes, in a second attempt of the same stage run."""
    script = repo / "stages" / "upper.py"
    script.write_text(script.read_text() + PREEMPTED)
    monkeypatch.setenv("TOY_PREEMPT_MARKER", str(tmp_path / "preempted-once"))
    seen: list[tuple[str, str, str]] = []
    recorded_between: list[str] = []

    def on_transition(e: StageTransition) -> None:
        seen.append((e.stage, e.state, e.reason))
        if e.state == "PREEMPTED":  # what an auditor reads before the next attempt starts
            with LineageStore.open() as store:
                recorded_between.append(store.require(StageRun, e.stage_run_id).state)

    ctx = start_pipeline(
        toy_pipeline(repo), toy_configs(), options=fast(), hooks=PipelineHooks(on_transition=on_transition)
    )
    result = run_stages(ctx, retries=0)
    assert result.state == "COMPLETED", result.error
    assert recorded_between == ["PREEMPTED"], "between attempts the stage run is preempted, not failed"
    (preempted,) = [s for s in seen if s[1] == "PREEMPTED"]
    assert preempted[0] == "upper" and preempted[2].startswith("job local-")
    assert "preempted: stopped by SIGTERM from outside" in preempted[2]
    assert not [s for s in seen if s[1] in ("FAILED", "RETRYING")], "a preemption is neither a failure nor a retry"
    with LineageStore.open() as store:
        (upper,) = store.list(StageRun, pipeline_run_id=result.pipeline_run.id, stage="upper")
        attempts = store.list(Attempt, stage_run_id=upper.id, order_by=Attempt.number)
        assert [(a.number, a.state, a.exit_code) for a in attempts] == [(1, "PREEMPTED", 143), (2, "COMPLETED", 0)]
        assert attempts[0].reason and "SIGTERM" in attempts[0].reason
        assert upper.state == "COMPLETED"

    # preempted every time: bounded by [pipeline] preemption_retries, then the stage fails
    monkeypatch.setenv("TOY_PREEMPT_ALWAYS", "1")
    monkeypatch.setenv("OPENLAB_PIPELINE__PREEMPTION_RETRIES", "1")
    again = run_pipeline(toy_pipeline(repo), toy_configs(), options=RunOptions(wait_poll=0.05, force=True))
    assert again.state == "FAILED" and again.results["upper"].state == "FAILED"
    assert "stopped 2 times in a row without saving progress, the limit ([pipeline] preemption_retries = 1)" in (
        again.error or ""
    ), again.error
    with LineageStore.open() as store:
        (upper,) = store.list(StageRun, pipeline_run_id=again.pipeline_run.id, stage="upper")
        assert [a.state for a in store.list(Attempt, stage_run_id=upper.id)] == ["PREEMPTED", "PREEMPTED"]
        assert upper.state == "FAILED" and "stopped 2 times" in (upper.error or ""), (upper.state, upper.error)


#: One step a job: the stage saves its step to ckpt.json (unless told to save nothing), then outlives
#: its time limit, until two steps are done; the job after that finishes the stage.
STEP_PER_JOB = (
    "\nckpt = out / 'ckpt.json'\n"
    "step = json.loads(ckpt.read_text())['step'] if ckpt.exists() else 0\n"
    "if step < 2:\n"
    "    if not os.environ.get('TOY_SAVE_NOTHING'):\n"
    "        (out / 'ckpt.tmp').write_text(json.dumps({'step': step + 1}))\n"
    "        os.replace(out / 'ckpt.tmp', ckpt)\n"
    "    time.sleep(60)\n"
)


def test_a_stage_stopped_by_its_time_limit_after_saving_progress_goes_on_from_it(
    repo: Path, ledger: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster's wall-time cap is shorter than a long training: each job gets further, saves its
    checkpoint, and is stopped by its time limit. That is progress, not failure: with no retries at
    all the stage goes on in new attempts of the same stage run, each resuming from the checkpoint,
    until it completes, however many jobs that takes (a month of 24-hour jobs is thirty): the
    preemption bound counts stops in a row that saved nothing, and this chain is longer than it. A
    stage that saved nothing stays FAILED at its limit, since a next attempt would be stopped at the
    same point again."""
    from tests.pipeline.toy import COMMON

    monkeypatch.setenv("OPENLAB_PIPELINE__PREEMPTION_RETRIES", "1")

    script = repo / "stages" / "upper.py"
    script.write_text(script.read_text().replace(COMMON, COMMON + STEP_PER_JOB, 1))
    toy = toy_pipeline(repo)
    stepped = [
        dataclasses.replace(s, checkpoint="ckpt.json", time_limit=1) if s.name == "upper" else s for s in toy.stages
    ]
    pipeline = dataclasses.replace(toy, stages=tuple(stepped))
    seen: list[StageTransition] = []
    hooks = PipelineHooks(on_transition=seen.append)

    result = run_stages(start_pipeline(pipeline, toy_configs(), options=fast(), hooks=hooks), retries=0)
    assert result.state == "COMPLETED", result.error
    going_on = [e for e in seen if e.state == "PREEMPTED"]
    assert len(going_on) == 2 and all(
        "time limit exceeded" in e.reason and "after saving ckpt.json anew" in e.reason for e in going_on
    )
    assert all(e.result and (e.result.stopped_by, e.result.progress_saved) == ("time-limit", True) for e in going_on)
    with LineageStore.open() as store:
        (upper,) = store.list(StageRun, pipeline_run_id=result.pipeline_run.id, stage="upper")
        attempts = store.list(Attempt, stage_run_id=upper.id, order_by=Attempt.number)
        assert [(a.number, a.state) for a in attempts] == [(1, "FAILED"), (2, "FAILED"), (3, "COMPLETED")]
        assert all((a.reason or "").startswith("time limit exceeded") for a in attempts[:2]), attempts
        assert [a.progress_saved for a in attempts] == [True, True, None], "their hours are not lost"
        assert upper.state == "COMPLETED"

    monkeypatch.setenv("TOY_SAVE_NOTHING", "1")
    again = run_stages(
        start_pipeline(pipeline, toy_configs(), options=RunOptions(wait_poll=0.05, force=True)), retries=0
    )
    assert again.state == "FAILED" and "time limit exceeded" in (again.error or ""), again.error
    with LineageStore.open() as store:
        (upper,) = store.list(StageRun, pipeline_run_id=again.pipeline_run.id, stage="upper")
        assert [(a.state, a.progress_saved) for a in store.list(Attempt, stage_run_id=upper.id)] == [("FAILED", None)]


#: Saves and stops on the warning ahead of the time limit (SIGUSR1), as the MoE workload does; the
#: job after that finds the checkpoint and finishes the stage.
SAVES_ON_WARNING = (
    "\nimport signal\n"
    "ckpt = out / 'ckpt.json'\n"
    "if not ckpt.exists():\n"
    "    def _save(signum, frame):\n"
    "        ckpt.write_text('{\"step\": 1}')\n"
    "        os._exit(128 + signum)\n"
    "    signal.signal(signal.SIGUSR1, _save)\n"
    "    time.sleep(60)\n"
)


def test_a_checkpointing_stage_is_warned_ahead_of_its_time_limit_and_goes_on_from_what_it_saved(
    repo: Path, ledger: Path
) -> None:
    """Stopped at the limit itself, a training stage has only the scheduler's grace to finish a step
    and save, and what it cannot save is computed again. A stage that checkpoints is sent SIGUSR1 a
    tenth of its limit ahead (Slurm's --signal=B:USR1@N; the local supervisor sends it itself): it
    saves and stops, and the next attempt goes on from there, no retry spent."""
    from tests.pipeline.toy import COMMON

    script = repo / "stages" / "upper.py"
    script.write_text(script.read_text().replace(COMMON, COMMON + SAVES_ON_WARNING, 1))
    toy = toy_pipeline(repo)
    warned = [
        dataclasses.replace(s, checkpoint="ckpt.json", time_limit=5) if s.name == "upper" else s for s in toy.stages
    ]
    seen: list[tuple[str, str, str]] = []
    hooks = PipelineHooks(on_transition=lambda e: seen.append((e.stage, e.state, e.reason)))
    ctx = start_pipeline(dataclasses.replace(toy, stages=tuple(warned)), toy_configs(), options=fast(), hooks=hooks)
    result = run_stages(ctx, retries=0)
    assert result.state == "COMPLETED", result.error
    (going_on,) = [reason for stage, state, reason in seen if state == "PREEMPTED"]
    assert "stopped by SIGUSR1" in going_on, going_on
    with LineageStore.open() as store:
        (upper,) = store.list(StageRun, pipeline_run_id=result.pipeline_run.id, stage="upper")
        attempts = store.list(Attempt, stage_run_id=upper.id, order_by=Attempt.number)
        assert [(a.number, a.state, a.exit_code) for a in attempts] == [(1, "PREEMPTED", 138), (2, "COMPLETED", 0)]
        assert attempts[0].resources["warn_before_limit"] == 1, attempts[0].resources


def test_preemption_retries_setting(monkeypatch: pytest.MonkeyPatch, repo: Path) -> None:
    assert preemption_retries(load_settings()) == 3
    monkeypatch.setenv("OPENLAB_PIPELINE__PREEMPTION_RETRIES", "0")
    assert preemption_retries(load_settings()) == 0
    monkeypatch.setenv("OPENLAB_PIPELINE__PREEMPTION_RETRIES", "-1")
    with pytest.raises(ConfigError, match=r"invalid \[pipeline\] preemption_retries -1: use a whole number"):
        start_pipeline(toy_pipeline(repo), toy_configs(), options=fast())


@pytest.mark.slurm
def test_a_stage_can_run_on_its_own_backend_and_where_it_ran_is_not_its_identity(repo: Path, ledger: Path) -> None:
    """Data prep here, the heavy stage on the cluster: one pipeline run, each attempt on its stage's
    backend; the same stages all on one backend afterwards reuse every result."""
    from dataclasses import replace

    from tests.services import require_slurm

    require_slurm()
    base = toy_pipeline(repo)
    mixed = replace(base, stages=tuple(replace(s, backend="slurm") if s.name == "count" else s for s in base.stages))
    first = run_pipeline(mixed, toy_configs(), options=fast())
    assert first.state == "COMPLETED", first.error
    with LineageStore.open() as store:
        run = store.require(PipelineRun, first.pipeline_run.id)
        assert run.backend == "local" and run.params["stage_backends"] == {"count": "slurm"}
        ran_on = {}
        for stage in store.list(StageRun, pipeline_run_id=run.id):
            (attempt,) = store.list(Attempt, stage_run_id=stage.id)
            ran_on[stage.stage] = (attempt.backend, attempt.state)
    assert ran_on == {"gen": ("local", "COMPLETED"), "upper": ("local", "COMPLETED"), "count": ("slurm", "COMPLETED")}
    again = run_pipeline(base, toy_configs(), options=fast())
    assert [r.state for r in again.results.values()] == ["REUSED"] * 3
    assert executions(ledger) == ["gen", "upper", "count"]
    assert [p.action for p in plan(mixed, toy_configs())] == ["reuse"] * 3  # the dry run agrees


def test_a_stage_on_a_container_backend_has_the_image_as_its_environment(repo: Path, ledger: Path) -> None:
    """Where a stage's own backend runs containers, its identity's environment is the image (as when
    the whole run is on that backend), so moving it there re-runs it, and only it: in a container,
    reading the local stages' outputs and leaving its own where the next run finds it."""
    from dataclasses import replace

    from tests.services import require_docker

    require_docker()
    base = toy_pipeline(repo)
    assert run_pipeline(base, toy_configs(), options=fast()).state == "COMPLETED"
    boxed = replace(base, stages=tuple(replace(s, backend="docker") if s.name == "count" else s for s in base.stages))
    plans = {p.stage: p for p in plan(boxed, toy_configs())}
    assert [plans[s].action for s in ("gen", "upper")] == ["reuse", "reuse"]
    assert plans["count"].action == "run" and any("environment" in c for c in plans["count"].changes), plans["count"]
    boxed_run = run_pipeline(boxed, toy_configs(), options=fast())
    assert [boxed_run.results[s].state for s in ("gen", "upper", "count")] == ["REUSED", "REUSED", "COMPLETED"]
    with LineageStore.open() as store:
        (count,) = store.list(StageRun, pipeline_run_id=boxed_run.pipeline_run.id, stage="count")
        (attempt,) = store.list(Attempt, stage_run_id=count.id)
        assert attempt.backend == "docker" and attempt.image and attempt.image_digest, attempt
        assert count.metrics["words"] == 2 * toy_configs()["gen"]["n"]  # "LINE i" per line, read in the container
    assert [p.action for p in plan(boxed, toy_configs())] == ["reuse"] * 3


def test_force_reruns_a_stage_with_the_same_identity(repo: Path, ledger: Path) -> None:
    """Forced, it runs again and says nothing of it changed, even when the latest run of the stage
    was of another identity (that run's differences are not why it ran)."""
    first = run_pipeline(toy_pipeline(repo), toy_configs(), options=fast())
    other = toy_configs()
    other["gen"]["n"] += 1
    assert run_pipeline(toy_pipeline(repo), other, options=fast()).results["gen"].state == "COMPLETED"
    same = f"identity {first.results['gen'].identity[:16]} unchanged since {first.results['gen'].stage_run_id}"
    (planned, *_) = plan(toy_pipeline(repo), toy_configs(), force=frozenset({"gen"}))
    assert (planned.action, planned.reason, planned.changes) == ("run", f"forced; {same}", [])
    forced = run_pipeline(
        toy_pipeline(repo), toy_configs(), options=RunOptions(force=frozenset({"gen"}), wait_poll=0.05)
    )
    assert forced.results["gen"].state == "COMPLETED"
    assert forced.results["gen"].identity == first.results["gen"].identity
    assert forced.results["upper"].state == "REUSED"  # byte-identical corpus
    assert executions(ledger) == ["gen", "upper", "count", "gen", "upper", "count", "gen"]
    assert forced.results["gen"].reason == f"forced; {same}"  # there was an earlier completed run: this one


def test_identity_ignores_location_and_runtime(
    repo: Path, ledger: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = run_pipeline(toy_pipeline(repo), toy_configs(), options=fast())
    configs = toy_configs()
    configs["gen"]["threads"] = 7  # runtime placement, not part of the identity
    plans = plan(toy_pipeline(repo), configs)
    assert plans[0].action == "reuse" and plans[0].identity == first.results["gen"].identity


def test_relation_rows_are_unique(repo: Path, ledger: Path) -> None:
    run_pipeline(toy_pipeline(repo), toy_configs(), options=fast())
    run_pipeline(toy_pipeline(repo), toy_configs(), options=fast())
    with LineageStore.open() as store:
        rels = store.list(Relation)
        keys = [(r.relation, r.subject_id, r.object_id, r.role) for r in rels]
        assert len(keys) == len(set(keys))


def test_volatile_links_leaving_the_output_are_dropped_before_hashing(repo: Path, ledger: Path, tmp_path: Path) -> None:
    """W&B offline folders link their debug log into ~/.cache; that must not fail the stage."""
    outside = tmp_path / "outside.log"
    outside.write_text("debug\n")
    script = repo / "stages" / "gen.py"
    script.write_text(
        script.read_text()
        + "(out / 'wandb' / 'run' / 'logs').mkdir(parents=True, exist_ok=True)\n"
        + f"os.symlink({str(outside)!r}, out / 'wandb' / 'run' / 'logs' / 'debug-core.log')\n"
    )
    result = run_pipeline(toy_pipeline(repo), toy_configs(), options=fast())
    assert result.ok, result.error
    assert not (result.results["gen"].out_dir / "wandb" / "run" / "logs" / "debug-core.log").exists()


def test_wandb_section_and_read_back_only_for_stages_that_track(
    repo: Path, ledger: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With a W&B project configured, a stage that never opens a W&B run (tokenize in the MoE
    pipeline) gets no ``wandb:`` section and no warning; a stage that declares it tracks but
    leaves no run behind is a real failure and warns."""
    import dataclasses
    import logging

    from orchestrator.pipeline import Pipeline

    monkeypatch.setenv("OPENLAB_WANDB__PROJECT", "toy-project")
    base = toy_pipeline(repo)
    stages = tuple(dataclasses.replace(s, tracks_wandb=s.name == "count") for s in base.stages)
    pipeline = Pipeline(name=base.name, stages=stages, repo_root=base.repo_root)
    with caplog.at_level(logging.WARNING, logger="openlab.pipeline"):
        result = run_pipeline(pipeline, toy_configs(), options=fast())
    assert result.ok, result.error
    warned = [r.getMessage() for r in caplog.records if "could not record the W&B run" in r.getMessage()]
    assert len(warned) == 1 and "of count" in warned[0], warned
    configs = {
        name: json.loads(r.out_dir.with_suffix(".config.json").read_text()) for name, r in result.results.items()
    }
    assert "wandb" not in configs["gen"] and "wandb" not in configs["upper"]
    assert configs["count"]["wandb"]["project"] == "toy-project"


def test_moe_pipeline_declares_which_stages_track_wandb() -> None:
    from orchestrator.pipeline import moe_pipeline

    tracking = {s.name for s in moe_pipeline().stages if s.tracks_wandb}
    assert tracking == {"pretrain", "midtrain", "posttrain", "eval"}  # data and tokenize never call wandb.init


def test_every_workload_module_a_stage_imports_is_in_its_identity() -> None:
    """tokenize imports data.py and training averages gradients in distributed.py; neither was declared,
    so an edit to either reused the stale result. Each stage's declared code is every module of the
    workload its program imports, however indirectly (the W&B helper alone is left out on purpose)."""
    import ast

    from orchestrator.pipeline import moe_pipeline
    from orchestrator.pipeline.dag import REPO_ROOT

    package = REPO_ROOT / "workloads" / "moe"

    def imported(module: str, seen: set[str]) -> set[str]:
        if module in seen:
            return seen
        seen.add(module)
        for node in ast.walk(ast.parse((package / module).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                imported(f"{node.module}.py", seen)
        return seen

    entry = {"data": "data.py", "tokenize": "tokenizing.py", "eval": "train.py", "repro": "repro.py"}
    pipeline = moe_pipeline(stages=["data", "tokenize", "repro"])
    specs = {s.name: s for s in [*moe_pipeline().stages, *pipeline.stages]}
    for name, spec in specs.items():
        needed = imported(entry.get(name, "train.py"), {"__main__.py"}) - {"tracking.py"}
        declared = {Path(p).name for p in spec.code_paths}
        assert needed <= declared, f"{name} does not declare {sorted(needed - declared)}"


def test_stage_interpreter_follows_where_the_job_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job in an image starts the image's `python3` (every image with a Python 3 has it; plain
    `python` only some); on the host (local, Slurm) this venv's, so a node's bare system Python
    never runs a stage; `[backends.<name>] python` overrides either."""
    from orchestrator.pipeline.dag import default_python

    assert default_python("docker", None, in_image=True) == "python3"
    assert default_python("slurm", None) == sys.executable
    cfg = tmp_path / "openlab.toml"
    cfg.write_text('[backends.kubernetes]\npython = "/opt/py/bin/python3"\n')
    monkeypatch.setenv("OPENLAB_CONFIG", str(cfg))
    settings = load_settings(tmp_path)
    assert default_python("kubernetes", settings, in_image=True) == "/opt/py/bin/python3"
    assert default_python("local", settings) == sys.executable
