"""`openlab gc`: old stage outputs leave the disk, their lineage stays, and a later run copes.

Real toy pipelines (real jobs, real git) on real SQLite and PostgreSQL (the `store` fixture);
the command as a subprocess and in a terminal.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from orchestrator.lineage import Artifact, LineageStore, StageRun, leases, utcnow
from orchestrator.lineage.verify import verify
from orchestrator.pipeline import (
    Pipeline,
    PipelineHooks,
    PipelineResult,
    RunOptions,
    StageSpec,
    execute,
    execute_stage,
    finish_pipeline,
    plan,
    run_pipeline,
    start_pipeline,
)
from orchestrator.pipeline.gc import (
    DATA_SNAPSHOT,
    IN_USE,
    LAST_RUNS,
    RECENT,
    RECENT_ATTEMPT,
    UNSYNCED_WANDB,
    GcPlan,
    Output,
    collect,
    folder_bytes,
    plan_gc,
)
from orchestrator.pipeline.outputs import output_dir
from orchestrator.settings import load_settings
from tests.pipeline.toy import git, make_repo, toy_configs, toy_pipeline

LATER = utcnow() + dt.timedelta(hours=1)  # "unused since an hour from now": age alone keeps nothing


def _options() -> RunOptions:
    return RunOptions(wait_poll=0.05, lease_ttl=10)


def _three_runs(repo: Path) -> dict[str, dict[str, str]]:
    """Three completed runs of the toy pipeline with different data: every stage's identity
    differs between them. Returns run label -> stage -> identity."""
    found = {}
    for label, n in (("a", 5), ("b", 6), ("c", 7)):
        result = run_pipeline(toy_pipeline(repo), toy_configs(n=n), options=_options())
        assert result.state == "COMPLETED", result.error
        found[label] = {name: r.identity for name, r in result.results.items()}
    return found


def _three_runs_with_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Path, dict[str, dict[str, str]]]:
    """:func:`_three_runs` in a new toy repository, its stage executions written to a ledger file
    (so a test can tell which stages ran again): the ledger, the repository and the identities."""
    ledger = tmp_path / "ledger.txt"
    monkeypatch.setenv("TOY_LEDGER", str(ledger))
    repo = make_repo(tmp_path)
    return ledger, repo, _three_runs(repo)


#: A training stage in miniature: it resumes from the checkpoint it finds in its output folder,
#: saves the next one, then crashes when $TOY_CRASH is set; otherwise it completes, saying where it began.
TRAIN = """
import json, os, sys
from pathlib import Path
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
out = Path(args["--out"]); out.mkdir(parents=True, exist_ok=True)
ckpt = out / "step.txt"
start = int(ckpt.read_text()) if ckpt.exists() else 0
ckpt.write_text(str(start + 1))
if os.environ.get("TOY_CRASH"):
    sys.exit("crashed after saving checkpoint " + str(start + 1))
(out / "metrics.json").write_text(json.dumps({"resumed_from": start}))
"""


def _train_pipeline(repo: Path) -> Pipeline:
    """The one-stage pipeline around :data:`TRAIN`, committed to the toy repository."""
    (repo / "stages" / "train.py").write_text(TRAIN)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "a resumable training stage")
    spec = StageSpec(
        name="train",
        inputs={},
        code_paths=("stages/train.py",),
        environment_fields=("python_version",),
        command=("{python}", "stages/train.py", "--config", "{config}", "--out", "{out}"),
    )
    return Pipeline(name="train", stages=(spec,), repo_root=repo)


def _train(pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, *, crash: bool, steps: int = 1) -> dict[str, object]:
    """Run the training pipeline once; returns its train stage's state, identity and metrics."""
    with monkeypatch.context() as env:
        if crash:
            env.setenv("TOY_CRASH", "1")
        result = run_pipeline(pipeline, {"train": {"steps": steps}}, options=_options())
    train = result.results["train"]
    assert result.state == ("FAILED" if crash else "COMPLETED"), result.error
    return {"state": train.state, "identity": train.identity, "metrics": train.metrics}


def _executions(ledger: Path) -> list[str]:
    return [line.split()[0] for line in ledger.read_text().splitlines()] if ledger.exists() else []


def test_gc_removes_unused_outputs_keeps_records_and_a_later_run_reruns_them(
    store: LineageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger, repo, ids = _three_runs_with_ledger(tmp_path, monkeypatch)
    settings = load_settings()

    # a fourth run, still going, has reused run b's first two stages: b's upper is in use now
    ctx = start_pipeline(toy_pipeline(repo), toy_configs(n=6), options=_options())
    for stage in ("gen", "upper"):
        assert execute_stage(ctx, stage).state == "REUSED"
    # everything is "old"; only the last completed run keeps its outputs by count
    gc_plan = plan_gc(store, settings, keep_last=1, used_since=LATER)
    label = {identity: f"{run}.{stage}" for run, stages in ids.items() for stage, identity in stages.items()}
    decided = {label[o.identity]: o.keep for o in gc_plan.outputs}
    assert decided == {
        "a.gen": DATA_SNAPSHOT,  # a recorded data snapshot: lineage verify proves data against it
        "b.gen": IN_USE,
        "c.gen": DATA_SNAPSHOT,
        "a.upper": None,
        "b.upper": IN_USE,
        "c.upper": LAST_RUNS,
        "a.count": None,
        "b.count": None,
        "c.count": LAST_RUNS,
    }, decided
    removable = {label[o.identity] for o in gc_plan.removable}
    assert all(o.bytes > 0 for o in gc_plan.removable)
    assert {r for o in gc_plan.outputs for r in o.recipes} == {"toy"}, "a pipeline without a recipe, by its name"

    done = collect(store, settings, gc_plan)
    assert {label[o.identity]: o.outcome for o in done} == {name: "removed" for name in removable}
    for o in done:
        assert not o.folder.exists() and not o.folder.with_suffix(".config.json").exists()
        assert not list(o.folder.parent.glob(f".{o.folder.name}.gc-*")), "nothing left aside"
    for run, stages in ids.items():  # what was kept is untouched
        for stage, identity in stages.items():
            if f"{run}.{stage}" not in removable:
                assert output_dir(settings, stage, identity).is_dir(), f"{run}.{stage}"
    finish_pipeline(ctx)

    # the records stay, each artifact saying when, by whom and why its bytes went
    removed = store.list(Artifact, where=[Artifact.removed_at.is_not(None)])  # type: ignore[union-attr]
    assert len(removed) == len(removable) == 3
    for art in removed:
        assert art.removed_reason and art.removed_reason.startswith("openlab gc by ")
        assert "in none of the last 1 completed runs" in art.removed_reason
    assert store.list(StageRun, where=[StageRun.identity == ids["a"]["upper"]])[0].state == "COMPLETED"
    assert verify(store, settings) == [], "a removal is recorded, not a broken record"

    # run a's data again: gen is reused, upper and count run again, saying why
    explained = {p.stage: p for p in plan(toy_pipeline(repo), toy_configs(n=5))}
    assert explained["gen"].action == "reuse"
    assert explained["upper"].action == "run"
    assert "outputs removed by openlab gc on" in explained["upper"].reason, explained["upper"].reason
    before = len(_executions(ledger))
    again = run_pipeline(toy_pipeline(repo), toy_configs(n=5), options=_options())
    assert again.state == "COMPLETED", again.error
    assert _executions(ledger)[before:] == ["upper", "count"]
    assert output_dir(settings, "upper", ids["a"]["upper"]).is_dir()
    assert verify(store, settings) == []

    # with a week's window, all of it is recent: nothing goes
    week = plan_gc(store, settings, keep_last=0, used_since=utcnow() - dt.timedelta(days=7))
    assert week.removable == [] and {o.keep for o in week.outputs} <= {RECENT, DATA_SNAPSHOT}


def test_an_offline_wandb_run_not_yet_synced_keeps_its_folder(store: LineageStore, tmp_path: Path) -> None:
    """Deleting an output would delete the offline W&B run inside it, whose history lineage keeps
    only as a summary: kept until `openlab wandb sync` has uploaded it (its record gets a URL)."""
    from orchestrator.lineage import WandbRun

    repo = make_repo(tmp_path)
    ids = _three_runs(repo)
    settings = load_settings()
    folder = output_dir(settings, "count", ids["a"]["count"])
    run_dir = folder / "wandb" / "offline-run-20261204_120000-abc123"
    run_dir.mkdir(parents=True)
    with store.transaction() as tx:
        wandb_run = tx.add(WandbRun(id="/openlab/abc123", run_id="abc123", project="openlab", local_dir=str(run_dir)))
    plan = plan_gc(store, settings, keep_last=1, used_since=LATER)
    decided = {o.identity: o.keep for o in plan.outputs}
    assert decided[ids["a"]["count"]] == UNSYNCED_WANDB and decided[ids["b"]["count"]] is None
    assert "1 with an unsynced W&B run" in plan.kept_summary() and "of the last runs" in plan.kept_summary()
    offline_for_good = plan_gc(store, settings, keep_last=1, used_since=LATER, keep_unsynced_wandb=False)
    assert {o.identity: o.keep for o in offline_for_good.outputs}[ids["a"]["count"]] is None, "asked to let it go"
    with store.transaction() as tx:
        tx.update(wandb_run, url="https://wandb.ai/lab/openlab/runs/abc123", mode="online")
    decided = {o.identity: o.keep for o in plan_gc(store, settings, keep_last=1, used_since=LATER).outputs}
    assert decided[ids["a"]["count"]] is None, "synced: the bytes are in W&B"


def test_an_identity_being_run_again_is_in_use(store: LineageStore, tmp_path: Path) -> None:
    """A forced re-run of an old identity, preempted and about to resume in its live pipeline run,
    writes its checkpoint into that identity's folder: the folder is in use, however old."""
    from orchestrator.lineage import PipelineRun

    repo = make_repo(tmp_path)
    ids = _three_runs(repo)
    settings = load_settings()
    with store.transaction() as tx:
        live = tx.add(PipelineRun(name="forced", state="RUNNING"))
        tx.add(StageRun(pipeline_run_id=live.id, stage="count", identity=ids["a"]["count"], state="PREEMPTED"))
    decided = {o.identity: o.keep for o in plan_gc(store, settings, keep_last=1, used_since=LATER).outputs}
    assert decided[ids["a"]["count"]] == IN_USE and decided[ids["b"]["count"]] is None


def test_gc_filters_narrow_what_may_go(store: LineageStore, tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    ids = _three_runs(repo)
    settings = load_settings()
    only_count = plan_gc(store, settings, keep_last=0, used_since=LATER, stages=["count"])
    assert {o.identity for o in only_count.removable} == {ids[r]["count"] for r in "abc"}
    assert plan_gc(store, settings, keep_last=0, used_since=LATER, recipe="another").outputs == []


def test_the_command(run_cli, run_cli_tty, store: LineageStore, tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    ids = _three_runs(repo)
    settings = load_settings()

    # a script that forgot --yes deletes nothing and says what to do
    refused = run_cli("gc", "--unused-for", "2026-01-01T00:00+00:00", "--keep", "0")
    assert refused.returncode == 0 and "0 to delete" in refused.stdout, refused.stdout + refused.stderr
    refused = run_cli("gc", "--unused-for", "0s", "--keep", "1")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.count("\n") == 1 and "pass --yes to delete them, or --dry-run" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert output_dir(settings, "upper", ids["a"]["upper"]).is_dir()

    # a checkout of a commit no run used since the cut goes as the outputs do: asked about, never without
    # --yes where nobody can be asked (it went, with "0 to delete" above it), and not by a narrowed gc
    cut = "2026-01-01T00:00+00:00"
    tree = settings.home / "worktrees" / ("a" * 40)
    tree.mkdir(parents=True)
    long_ago = dt.datetime(2025, 6, 1, tzinfo=dt.UTC).timestamp()
    os.utime(tree, (long_ago, long_ago))
    narrowed = run_cli("gc", "--unused-for", cut, "--keep", "0", "--stage", "count")
    assert narrowed.returncode == 0 and "worktree" not in narrowed.stdout and tree.is_dir(), narrowed.stdout
    asked = run_cli("gc", "--unused-for", cut, "--keep", "0")
    assert asked.returncode == 2 and tree.is_dir(), asked.stdout + asked.stderr
    assert "0 output folder(s) and 1 git worktree(s) (0 bytes of outputs) would be deleted: pass --yes" in asked.stderr
    listed = json.loads(run_cli("gc", "--unused-for", cut, "--keep", "0", "--dry-run", "--json").stdout)
    assert listed["worktrees"] == [str(tree)] and tree.is_dir()
    done = run_cli("gc", "--unused-for", cut, "--keep", "0", "--yes")
    assert done.returncode == 0 and "removed 1 git worktree(s)" in done.stdout and not tree.exists(), done.stdout

    looked = run_cli("gc", "--unused-for", "0s", "--keep", "1", "--dry-run", "--json")
    assert looked.returncode == 0, looked.stderr
    report = json.loads(looked.stdout)
    assert report["dry_run"] is True and report["bytes_removable"] > 0
    assert {o["identity"] for o in report["remove"]} == {ids[r][s] for r in "ab" for s in ("upper", "count")}
    assert output_dir(settings, "upper", ids["a"]["upper"]).is_dir(), "a dry run removes nothing"

    for bad, message in ((["--keep", "-1"], "invalid --keep -1"), (["--unused-for", "soon"], "cannot read 'soon'")):
        out = run_cli("gc", *bad)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr

    code, screen = run_cli_tty("gc", "--unused-for", "0s", "--keep", "1", "--stage", "count", "--yes")
    assert code == 0, screen
    assert "stage outputs to delete" in screen and "removed 2 output folder(s)" in screen, screen
    assert not output_dir(settings, "count", ids["a"]["count"]).exists()
    assert output_dir(settings, "upper", ids["a"]["upper"]).is_dir(), "--stage count left upper alone"


def test_a_crashed_runs_checkpoints_go_only_when_asked_and_the_next_run_starts_afresh(
    store: LineageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An identity that never completed leaves the partial checkpoint a retry resumes from: plain gc
    never touches it; --include-failed removes it once no attempt touched it for the window, records
    the removal, and the next run of that identity starts from step 0 instead of a checkpoint
    that is gone."""
    pipeline = _train_pipeline(make_repo(tmp_path))
    settings = load_settings()
    # what a retry does when the checkpoint is there: it resumes (another identity, left alone)
    resumed = _train(pipeline, monkeypatch, crash=True, steps=2)
    assert _train(pipeline, monkeypatch, crash=False, steps=2)["metrics"] == {"resumed_from": 1}

    crashed = _train(pipeline, monkeypatch, crash=True)
    identity = str(crashed["identity"])
    folder = output_dir(settings, "train", identity)
    assert (folder / "step.txt").read_text() == "1"

    plain = plan_gc(store, settings, keep_last=0, used_since=LATER)
    assert identity not in {o.identity for o in plain.outputs}, "without the flag a crashed run's folder is not gc's"
    month = plan_gc(
        store,
        settings,
        keep_last=0,
        used_since=LATER,
        include_failed=True,
        failed_used_since=utcnow() - dt.timedelta(days=30),
    )
    (kept,) = [o for o in month.outputs if o.identity == identity]
    assert kept.keep == RECENT_ATTEMPT and kept.state.startswith("failed, last attempt "), kept

    gc_plan = plan_gc(store, settings, keep_last=0, used_since=LATER, include_failed=True, failed_used_since=LATER)
    decided = {o.identity: o for o in gc_plan.outputs}
    assert decided[identity].keep is None and not decided[identity].completed
    assert decided[str(resumed["identity"])].completed, "the identity that completed on retry is a completed output"
    assert gc_plan.to_dict()["include_failed"] is True
    done = collect(store, settings, gc_plan)
    assert {o.identity: o.outcome for o in done}[identity] == "removed"
    assert not folder.exists() and not folder.with_suffix(".config.json").exists()

    # no artifact named the folder: the removal is a record of its own, generated by the crashed run
    (record,) = store.list(Artifact, where=[Artifact.uri == str(folder)])
    assert record.removed_at is not None and "never completed (failed, last attempt" in (record.removed_reason or "")
    (attempt,) = store.list(StageRun, where=[StageRun.identity == identity])
    assert [(r.relation, r.object_id) for r in store.relations(record.id)] == [("wasGeneratedBy", attempt.id)]
    assert [e.action for e in store.events(record.id)] == ["create"]
    assert verify(store, settings) == []

    again = _train(pipeline, monkeypatch, crash=False)
    assert again["identity"] == identity and again["state"] == "COMPLETED"
    assert again["metrics"] == {"resumed_from": 0}, "started from scratch, not from the removed checkpoint"
    assert verify(store, settings) == []


def test_a_failed_retry_after_gc_keeps_its_checkpoint(
    store: LineageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc removed a completed identity's outputs; a later run of it crashed and left a fresh partial
    checkpoint in the same folder. The old completed run no longer stands behind those bytes:
    plain gc must not delete them because that run is old."""
    pipeline = _train_pipeline(make_repo(tmp_path))
    settings = load_settings()
    identity = str(_train(pipeline, monkeypatch, crash=False)["identity"])
    assert [o.outcome for o in collect(store, settings, plan_gc(store, settings, keep_last=0, used_since=LATER))] == [
        "removed"
    ]
    _train(pipeline, monkeypatch, crash=True)
    assert (output_dir(settings, "train", identity) / "step.txt").read_text() == "1"

    assert plan_gc(store, settings, keep_last=0, used_since=LATER).outputs == []
    (partial,) = plan_gc(store, settings, keep_last=0, used_since=LATER, include_failed=True).outputs
    assert partial.keep == RECENT_ATTEMPT and partial.state.startswith("failed, last attempt "), partial


def test_the_command_with_include_failed(
    run_cli, run_cli_tty, store: LineageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain `openlab gc` leaves a crashed run's folder out of its report; --include-failed reports
    it with its state, keeps it within --failed-unused-for and removes it after."""
    pipeline = _train_pipeline(make_repo(tmp_path))
    identity = str(_train(pipeline, monkeypatch, crash=True)["identity"])
    folder = output_dir(load_settings(), "train", identity)

    plain = json.loads(run_cli("gc", "--unused-for", "0s", "--keep", "0", "--dry-run", "--json").stdout)
    assert plain["remove"] == plain["kept"] == [] and plain["include_failed"] is False

    looked = run_cli("gc", "--include-failed", "--dry-run", "--json")
    assert looked.returncode == 0, looked.stderr
    (kept,) = json.loads(looked.stdout)["kept"]
    assert kept["identity"] == identity and kept["keep"] == RECENT_ATTEMPT, kept
    assert kept["state"].startswith("failed, last attempt ") and kept["made_by"], kept

    looked = run_cli("gc", "--include-failed", "--failed-unused-for", "0s", "--dry-run")
    assert looked.returncode == 0 and "│ failed " in looked.stdout, looked.stdout + looked.stderr
    assert "1 to delete" in looked.stdout and identity[:8] in looked.stdout, looked.stdout
    assert folder.is_dir(), "a dry run removes nothing"

    for bad, message in (
        (["--failed-unused-for", "1d"], "--failed-unused-for applies only with --include-failed"),
        (["--include-failed", "--failed-unused-for", "soon"], "cannot read 'soon'"),
    ):
        out = run_cli("gc", "--dry-run", *bad)
        assert out.returncode == 2 and message in out.stderr, out.stdout + out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr

    code, screen = run_cli_tty("gc", "--include-failed", "--failed-unused-for", "0s", "--yes")
    assert code == 0 and "removed 1 output folder(s)" in screen, screen
    assert not folder.exists()


def _only(gc_plan: GcPlan, *identities: str) -> GcPlan:
    """The plan narrowed to these identities' outputs (as if the others were kept)."""
    gc_plan.outputs = [o for o in gc_plan.outputs if o.identity in identities]
    assert len(gc_plan.removable) == len(identities)
    return gc_plan


def test_a_reuse_that_verified_just_before_gc_removed_the_folder_runs_the_stage_again(
    store: LineageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reuse check reads the outputs before taking the lease; gc removes them right after.
    The reuse is decided again under the lease, sees the removal, and runs the stage: without that,
    the run would record a reuse of a deleted folder and its next stage would fail to read it."""
    ledger, repo, ids = _three_runs_with_ledger(tmp_path, monkeypatch)
    settings = load_settings()
    gc_plan = _only(plan_gc(store, settings, keep_last=0, used_since=LATER), ids["a"]["upper"], ids["a"]["count"])

    verified = execute.find_reusable
    removed: list[Output] = []

    def gc_strikes_after_the_check(
        store_: LineageStore, identity: str, *args: Any, **kw: Any
    ) -> tuple[StageRun | None, str]:
        found = verified(store_, identity, *args, **kw)
        if identity == ids["a"]["upper"] and not removed:
            assert found[0] is not None, "upper verified: it would be reused"
            removed.extend(collect(store, settings, gc_plan))
        return found

    monkeypatch.setattr(execute, "find_reusable", gc_strikes_after_the_check)
    before = len(_executions(ledger))
    again = run_pipeline(toy_pipeline(repo), toy_configs(n=5), options=_options())
    assert [o.outcome for o in removed] == ["removed", "removed"]
    assert again.state == "COMPLETED", again.error
    assert {s: r.state for s, r in again.results.items()} == {
        "gen": "REUSED",
        "upper": "COMPLETED",
        "count": "COMPLETED",
    }
    assert _executions(ledger)[before:] == ["upper", "count"]
    assert verify(store, settings) == []


def test_a_reuse_waits_while_gc_holds_the_lease_then_runs_the_stage_again(
    store: LineageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc holds the identity's lease while it deletes; a run that wants to reuse that identity
    then waits for the lease instead of recording a reuse of a folder about to go, and runs it."""
    ledger, repo, ids = _three_runs_with_ledger(tmp_path, monkeypatch)
    settings = load_settings()
    upper = ids["a"]["upper"]
    gc_plan = _only(plan_gc(store, settings, keep_last=0, used_since=LATER), upper)

    seen: list[str] = []
    turned = threading.Event()  # the run waits for gc's lease on upper, or it ended without waiting
    result: list[PipelineResult] = []

    def on_transition(t: execute.StageTransition) -> None:
        seen.append(f"{t.stage} {t.state}")
        if t.stage == "upper" and t.state == "WAITING":
            turned.set()

    def run_a() -> None:
        try:
            hooks = PipelineHooks(on_transition=on_transition)
            result.append(run_pipeline(toy_pipeline(repo), toy_configs(n=5), options=_options(), hooks=hooks))
        finally:
            turned.set()

    runner = threading.Thread(target=run_a)
    held_by = leases.try_hold

    def gc_holds_it_when_the_run_arrives(
        store_: LineageStore, identity: str, holder: str, **kw: Any
    ) -> leases.HeldLease | None:
        held = held_by(store_, identity, holder, **kw)
        if held is not None and ":gc:" in holder:
            runner.start()
            assert turned.wait(120), "the run neither waited nor ended"
        return held

    monkeypatch.setattr(leases, "try_hold", gc_holds_it_when_the_run_arrives)
    before = len(_executions(ledger))
    assert [o.outcome for o in collect(store, settings, gc_plan)] == ["removed"]
    runner.join()
    assert "upper WAITING" in seen, seen
    (again,) = result
    assert again.state == "COMPLETED", again.error
    assert again.results["upper"].state == "COMPLETED" and _executions(ledger)[before:] == ["upper"]
    assert output_dir(settings, "upper", upper).is_dir()
    assert verify(store, settings) == []


def test_gc_keeps_an_output_a_run_reused_after_it_planned(
    store: LineageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run reuses an output between gc's plan and its removal, and even finishes: the output is
    recent again, so gc skips it rather than delete what that run (and tomorrow's) relies on."""
    ledger, repo, ids = _three_runs_with_ledger(tmp_path, monkeypatch)
    settings = load_settings()
    gc_plan = _only(plan_gc(store, settings, keep_last=0, used_since=LATER), ids["a"]["upper"], ids["b"]["upper"])
    reused = run_pipeline(toy_pipeline(repo), toy_configs(n=5), options=_options())
    assert reused.results["upper"].state == "REUSED"

    done = {o.identity: o.outcome for o in collect(store, settings, gc_plan)}
    assert done == {ids["a"]["upper"]: "skipped: a run used it since gc planned", ids["b"]["upper"]: "removed"}
    assert output_dir(settings, "upper", ids["a"]["upper"]).is_dir()
    before = len(_executions(ledger))
    assert run_pipeline(toy_pipeline(repo), toy_configs(n=5), options=_options()).state == "COMPLETED"
    assert _executions(ledger)[before:] == [], "everything reused"


def test_a_forced_rerun_marks_what_it_replaced_and_verify_stays_clean(
    store: LineageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--force` deletes a completed identity's folder and writes it again (other bytes: the toy's
    metrics carry the wall clock). The first run's artifact and data snapshot must say their bytes
    were replaced and by which stage run, so `lineage verify` does not report them as corrupted."""
    from orchestrator.lineage import DataSnapshot

    repo = make_repo(tmp_path)
    settings = load_settings()
    first = run_pipeline(toy_pipeline(repo), toy_configs(), options=_options())
    assert first.state == "COMPLETED", first.error
    forced = run_pipeline(
        toy_pipeline(repo), toy_configs(), options=RunOptions(wait_poll=0.05, lease_ttl=10, force=frozenset({"gen"}))
    )
    assert forced.results["gen"].state == "COMPLETED", forced.error
    old, new = (store.require(StageRun, r.results["gen"].stage_run_id).outputs["out"] for r in (first, forced))
    assert old["content_hash"] != new["content_hash"], "the re-run wrote other bytes"

    replaced = store.require(Artifact, old["artifact_id"])
    assert replaced.removed_at is not None
    assert replaced.removed_reason == (
        f"replaced by a forced re-run of the same identity: stage run {forced.results['gen'].stage_run_id} "
        f"of {forced.pipeline_run.id}"
    )
    from orchestrator.lineage.trace import describe

    assert describe(replaced).endswith(f"(removed {replaced.removed_at:%Y-%m-%d}: {replaced.removed_reason})")
    old_snap, new_snap = (store.require(DataSnapshot, o["snapshot_id"]) for o in (old, new))
    assert old_snap.removed_at is not None and old_snap.removed_reason == replaced.removed_reason
    assert new_snap.removed_at is None and store.require(Artifact, new["artifact_id"]).removed_at is None
    assert verify(store, settings) == []
    # the folder is a live data snapshot again (the new one): gc still keeps it
    gen = [o for o in plan_gc(store, settings, keep_last=0, used_since=LATER).outputs if o.stage == "gen"]
    assert [o.keep for o in gen] == [DATA_SNAPSHOT]


def test_a_failed_forced_rerun_leaves_a_failed_identity(
    store: LineageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forced re-run that crashes leaves a partial checkpoint where the completed outputs were.
    The completed run no longer stands behind the folder: the next run says why it runs the stage
    again, plain gc leaves the checkpoint (a retry resumes from it) and verify stays clean."""
    pipeline = _train_pipeline(make_repo(tmp_path))
    settings = load_settings()
    done = _train(pipeline, monkeypatch, crash=False)
    identity = str(done["identity"])
    with monkeypatch.context() as env:
        env.setenv("TOY_CRASH", "1")
        forced = run_pipeline(
            pipeline, {"train": {"steps": 1}}, options=RunOptions(wait_poll=0.05, lease_ttl=10, force=True)
        )
    assert forced.state == "FAILED" and forced.results["train"].identity == identity
    assert verify(store, settings) == []

    (step,) = plan(pipeline, {"train": {"steps": 1}})
    assert step.action == "run"
    assert "outputs replaced on " in step.reason and "by a forced re-run of the same identity" in step.reason, step
    assert plan_gc(store, settings, keep_last=0, used_since=LATER).outputs == [], "not a completed output any more"
    (partial,) = plan_gc(store, settings, keep_last=0, used_since=LATER, include_failed=True).outputs
    assert not partial.completed and partial.keep == RECENT_ATTEMPT, partial

    again = _train(pipeline, monkeypatch, crash=False)
    assert again["state"] == "COMPLETED" and again["metrics"] == {"resumed_from": 1}, "resumed the forced run's step"
    assert verify(store, settings) == []


def test_a_replaced_snapshot_captured_again_is_live_again(store: LineageStore, tmp_path: Path) -> None:
    """A deterministic data stage forced again writes the same bytes: the snapshot its first run
    recorded (marked removed when the folder was deleted) is the same content, there again."""
    from orchestrator.lineage.record import live_records_at, mark_removed, record_snapshot
    from orchestrator.snapshots import snapshot

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("same bytes\n")
    settings = load_settings()
    with store.transaction() as tx:
        first = record_snapshot(tx, snapshot(folder, settings=settings))
    assert [r.id for r in live_records_at(store, folder)] == [first.id]
    with store.transaction() as tx:
        mark_removed(tx, live_records_at(store, folder), utcnow(), "replaced by a test")
    assert live_records_at(store, folder) == []
    with store.transaction() as tx:
        again = record_snapshot(tx, snapshot(folder, settings=settings))
    assert again.id == first.id and again.removed_at is None and again.removed_reason is None
    assert [e.action for e in store.events(first.id)] == ["create", "update", "update"]
    assert verify(store, settings) == []


def test_deleting_a_folder_marks_only_what_is_under_it_not_what_its_name_matches_as_a_pattern(
    store: LineageStore, tmp_path: Path
) -> None:
    """Paths were matched with LIKE: removing ``run_1`` (``_`` is any one character there) marked
    ``runX1``'s snapshot removed too, and `lineage verify` no longer checked its bytes."""
    from orchestrator.lineage.record import live_records_at, record_snapshot
    from orchestrator.snapshots import snapshot

    settings = load_settings()
    recorded = {}
    for name in ("run_1", "runX1"):
        (tmp_path / name / "data").mkdir(parents=True)
        (tmp_path / name / "data" / "a.txt").write_text(f"{name}\n")
        with store.transaction() as tx:
            recorded[name] = record_snapshot(tx, snapshot(tmp_path / name / "data", settings=settings)).id
    assert [r.id for r in live_records_at(store, tmp_path / "run_1")] == [recorded["run_1"]]


def test_the_bytes_gc_frees_count_a_hard_linked_revision_once(tmp_path: Path) -> None:
    """A checkpoint revision is a hard link to the checkpoint saved at its step: removing the folder
    frees those bytes once, and a symlink's target is not the folder's."""
    out = tmp_path / "pretrain"
    (out / "checkpoint" / "revisions").mkdir(parents=True)
    (out / "checkpoint" / "state.pt").write_bytes(b"x" * 1000)
    os.link(out / "checkpoint" / "state.pt", out / "checkpoint" / "revisions" / "step-000006.pt")
    (out / "metrics.json").write_bytes(b"y" * 50)
    (tmp_path / "elsewhere").write_bytes(b"z" * 4000)
    (out / "link").symlink_to(tmp_path / "elsewhere")
    assert folder_bytes(out) == 1050
