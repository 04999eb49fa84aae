"""`openlab sweep`: a grid of recipe values from a terminal, one real pipeline run per combination."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.cards import pipeline_card
from orchestrator.lineage import Attempt, LineageStore, PipelineRun, StageRun

ARGS = ("sweep", "marin-535b-a23b", "--replica", "tiny", "--until", "data")
BYTES = "data:data/code/train_bytes"


def test_a_sweep_runs_each_combination_as_a_recorded_run_and_compares_them(run_cli, openlab_home: Path) -> None:
    """Each value is an ordinary run with what it set recorded; the comparison lists them in the grid's
    order with what each measured; a later sweep sharing a value reuses that run's stage."""
    done = run_cli(*ARGS, "-g", "data.max_bytes_per_domain=150000,120000", "-m", BYTES, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert [(t["number"], t["set"], t["state"]) for t in doc["trials"]] == [
        (1, {"data.max_bytes_per_domain": 150000}, "COMPLETED"),
        (2, {"data.max_bytes_per_domain": 120000}, "COMPLETED"),
    ]
    ids = [t["pipeline_run_id"] for t in doc["trials"]]
    rows = doc["comparison"]["runs"]
    assert [r["id"] for r in rows] == ids  # the grid's order, whichever started first
    assert [r["asked"]["set.data.max_bytes_per_domain"] for r in rows] == [150000, 120000]
    measured = [r["metrics"]["data"]["data/code/train_bytes"] for r in rows]
    assert 120000 > measured[1] > 0 and 150000 > measured[0] > measured[1], measured
    sweep_id = doc["sweep"]
    assert sweep_id.startswith("swp_") and {t["sweep"] for t in doc["trials"]} == {sweep_id}
    with LineageStore.open() as store:
        for trial in doc["trials"]:
            run = store.get(PipelineRun, trial["pipeline_run_id"])
            assert run.params["recipe"]["run_set"] == trial["set"]  # an ordinary `--set` run
            assert run.command[:3] == ["openlab", "sweep", "marin-535b-a23b"], run.command  # what was typed
            assert run.sweep == {"id": sweep_id, "run": trial["number"], "of": 2}  # which sweep, which of its runs
        card = pipeline_card(store, ids[1])
    assert f"**Sweep:** run 2 of 2 of `{sweep_id}` (`` openlab lineage compare --sweep {sweep_id} ``)" in card, card
    listed = json.loads(run_cli("lineage", "list", "--sweep", sweep_id[:10], "-k", "pipeline_run", "--json").stdout)
    assert sorted(r["id"] for r in listed) == sorted(ids)  # a prefix of its id finds the sweep
    shown = run_cli("lineage", "list", "--sweep", sweep_id, "-k", "pipeline_run", env={"COLUMNS": "200"}).stdout
    assert f"sweep {sweep_id} 2/2" in " ".join(shown.split()), shown

    # the dry run: per run and stage what it would do, a stage two runs share counted once; nothing recorded
    grid = ("-g", "pretrain.lr=0.01,0.02", "-g", "data.max_bytes_per_domain=150000,130000")
    dry = run_cli(*ARGS[:4], "--until", "pretrain", *grid, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)
    assert [[t["stages"][s] for s in ("data", "tokenize", "pretrain")] for t in planned["trials"]] == [
        ["reuse", "run", "run"],  # 0.01, 150000: its data is the first sweep's
        ["run", "run", "run"],  # 0.01, 130000
        ["reuse", "shared", "run"],  # 0.02, 150000: tokenized by the first run of this sweep
        ["shared", "shared", "run"],  # 0.02, 130000
    ], planned["trials"]
    assert planned["jobs"] == {"data": 1, "tokenize": 2, "pretrain": 4}
    assert len(_runs()) == 2  # nothing was started or recorded
    text = run_cli(*ARGS[:4], "--until", "pretrain", *grid, "--dry-run", env={"COLUMNS": "200"}).stdout
    assert "it would start 7 jobs:" in text and "  pretrain: 4 (each asks cpus=2 mem=4G time=30m)" in text, text
    assert "4. lr=0.02 max_bytes_per_domain=130000" in text, text  # each run by the values that tell it apart

    # one after another, in a pipe: a line per stage naming its run, the table, the command to see it again
    again = run_cli(
        *ARGS,
        "-g",
        "data.max_bytes_per_domain=150000,130000",
        "-m",
        BYTES,
        "--at-once",
        "1",
        "--over",
        "data.max_bytes_per_domain",
    )
    assert again.returncode == 0, again.stderr
    assert "sweep 1/2 (data.max_bytes_per_domain=150000): data REUSED" in again.stderr, again.stderr
    assert "sweep 2/2 (data.max_bytes_per_domain=130000): data COMPLETED" in again.stderr, again.stderr
    (line,) = [x for x in again.stdout.splitlines() if x.startswith("again: openlab lineage compare ")]
    with LineageStore.open() as store:
        newest = [r.id for r in store.list(PipelineRun, order_by=PipelineRun.started_at)][-2:]
        first, second = (store.list(StageRun, pipeline_run_id=i)[0] for i in newest)
        assert (first.state, second.state) == ("REUSED", "COMPLETED")
        assert first.started_at < second.started_at  # --at-once 1: the second waited for the first
    (later,) = {r.sweep["id"] for r in _runs() if r.id in newest}  # a sweep of its own
    assert later != sweep_id, later
    assert line == f"again: openlab lineage compare --sweep {later} -m {BYTES} --over data.max_bytes_per_domain", line
    assert "each metric: mean ± standard deviation over data.max_bytes_per_domain" in again.stdout, again.stdout
    compared = json.loads(run_cli("lineage", "compare", "--sweep", sweep_id, "-m", BYTES, "--json").stdout)
    assert [r["id"] for r in compared["runs"]] == ids  # the first sweep alone, in its grid's order


def test_a_sampled_sweep_runs_count_different_draws_and_the_same_seed_draws_them_again(
    run_cli, openlab_home: Path
) -> None:
    """Random search: `--sample KEY=DIST --count N` runs N drawn values, each recorded as the run's
    value with how it was drawn; the same sweep again draws the same values and reuses their runs."""
    sample = ("--sample", "data.max_bytes_per_domain=int(100000,150000)", "--count", "2", "-m", BYTES)
    done = run_cli(*ARGS, *sample, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    drawn = [t["set"]["data.max_bytes_per_domain"] for t in doc["trials"]]
    assert len(set(drawn)) == 2 and all(100000 <= v <= 150000 for v in drawn), drawn
    assert [t["state"] for t in doc["trials"]] == ["COMPLETED", "COMPLETED"]
    rows = doc["comparison"]["runs"]
    assert [r["asked"]["set.data.max_bytes_per_domain"] for r in rows] == drawn  # the table shows what was drawn
    with LineageStore.open() as store:
        runs = [store.require(PipelineRun, t["pipeline_run_id"]) for t in doc["trials"]]
    how = {"samples": {"data.max_bytes_per_domain": "int(100000, 150000)"}, "count": 2, "seed": 0}
    assert all(r.sweep["sampled"] == how for r in runs), [r.sweep for r in runs]
    assert [r.params["recipe"]["run_set"] for r in runs] == [{"data.max_bytes_per_domain": v} for v in drawn]

    again = json.loads(run_cli(*ARGS, *sample, "--json").stdout)  # the same seed: the same draws, reused
    assert [t["set"]["data.max_bytes_per_domain"] for t in again["trials"]] == drawn
    with LineageStore.open() as store:
        reran = [store.list(StageRun, pipeline_run_id=t["pipeline_run_id"])[0] for t in again["trials"]]
    assert [s.state for s in reran] == ["REUSED", "REUSED"]
    other = json.loads(run_cli(*ARGS, *sample, "--sample-seed", "1", "--dry-run", "--json").stdout)
    assert [t["set"]["data.max_bytes_per_domain"] for t in other["trials"]] != drawn  # another seed: other values


def test_a_bad_grid_stops_the_sweep_before_anything_runs(run_cli, openlab_home: Path) -> None:
    """Every combination is checked against the recipe first: one line, exit 2, nothing recorded."""
    for grid, extra, message in (
        ("data.max_bytes=1,2", (), "--grid data.max_bytes: no such recipe field"),
        ("pretrain.lr=0.01,0.02", ("--set", "data.max_bytes=1"), "--set data.max_bytes: no such recipe field"),
        ("pretrain.lr=0.01,fast", (), "pretrain.lr"),
        ("pretrain.lr=0.01,0.02", ("--set", "pretrain.lr=0.03"), "pretrain.lr is both swept and set for every run"),
        ("pretrain.lr", (), "--grid 'pretrain.lr': expected KEY=V1,V2,..."),
        ("pretrain.lr=0.01,0.02", ("--over", "seed"), "--over 'seed': not a key of the grid; grid keys: pretrain.lr"),
        ("seed=0,1,0", (), "sweep: seed: the value 0 is given twice"),
        ("seed=0,1", ("--sample", "seed=int(0,9)", "--count", "2"), "sweep: seed is both sampled and swept"),
        ("seed=0,1", ("--sample", "pretrain.lrr=uniform(0.01,0.02)", "--count", "2"), "--sample pretrain.lrr: no such"),
        ("seed=0,1", ("--count", "2"), "--sample and --count go together"),
        ("seed=0,1", ("--issue", "lab/exp"), "malformed issue reference 'lab/exp'"),
    ):
        bad = run_cli(*ARGS, "-g", grid, *extra)
        assert bad.returncode == 2, (grid, bad.stdout, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1 and message in bad.stderr, (grid, bad.stderr)
        assert "Traceback" not in bad.stderr
    assert not (openlab_home / "lineage.db").exists() or _runs() == []


def _runs() -> list[PipelineRun]:
    with LineageStore.open() as store:
        return store.list(PipelineRun)


def test_ctrl_c_cancels_the_running_runs_and_their_jobs_and_starts_no_other(openlab_home: Path) -> None:
    """Ctrl-C (SIGINT) during a sweep: the running run's job is cancelled and recorded CANCELLED with
    why, the queued one never starts, and what ran is still compared; exit 130."""
    sweep = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli.main", *ARGS[:4], "--until", "pretrain", "--at-once", "1"]
        + ["-g", "pretrain.lr=0.011,0.012", "--set", "tokens.budget=2048000"],  # a pretrain of minutes
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "COLUMNS": "200"},
    )
    assert sweep.stderr is not None
    seen = []
    deadline = time.monotonic() + 240
    for line in sweep.stderr:  # a line per stage transition: wait until the first run trains
        seen.append(line)
        if "pretrain RUNNING" in line or time.monotonic() > deadline:
            break
    assert "pretrain RUNNING" in seen[-1], "".join(seen)
    time.sleep(2)
    sweep.send_signal(signal.SIGINT)
    out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, "".join(seen) + err
    assert "run 2 (pretrain.lr=0.012) NOT STARTED: the sweep was stopped before it started" in err, err
    assert "interrupted: the runs that had not ended were cancelled" in err, err
    assert not [x for x in err.splitlines() if x.startswith("pretrain CANCELLED")], err  # once, under its run's name
    with LineageStore.open() as store:
        (run,) = store.list(PipelineRun)  # the second never started
        assert run.params["recipe"]["run_set"]["pretrain.lr"] == 0.011 and run.state == "CANCELLED"
        (pretrain,) = store.list(StageRun, pipeline_run_id=run.id, stage="pretrain")
        assert pretrain.state == "CANCELLED" and "the sweep was stopped" in (pretrain.error or ""), pretrain.error
        (attempt,) = store.list(Attempt, stage_run_id=pretrain.id)
        assert attempt.state == "CANCELLED" and attempt.ended_at is not None
    assert f"again: openlab lineage compare {run.id}" in out, out


def test_a_runs_line_keeps_the_values_that_tell_it_apart_in_a_narrow_terminal() -> None:
    """Keys are cut to the shortest tail no other swept key shares: the value still shows at 80 columns."""
    from orchestrator.cli.sweep import short_labels

    assert short_labels([{"data.max_bytes_per_domain": 150000, "seed": 1}]) == ["max_bytes_per_domain=150000 seed=1"]
    assert short_labels([{"pretrain.lr": 0.01, "midtrain.lr": 0.02}]) == ["pretrain.lr=0.01 midtrain.lr=0.02"]
    assert short_labels([{"pretrain.mixture": {"code": 0.5}}]) == ['mixture={"code": 0.5}']


def test_a_run_that_crashes_stays_in_the_sweep_and_the_others_go_on(
    openlab_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in one run (an exception that is no refusal) fails that run, recorded FAILED and kept in
    the sweep's results with its pipeline run, and does not stop the others."""
    from orchestrator.pipeline import RunOptions, finish_pipeline, run_stages
    from orchestrator.pipeline import sweep as sweep_module
    from orchestrator.pipeline.execute import PipelineHooks

    def crash_the_first(ctx, retries: int = 0):  # what run_stages does on an unexpected error: close, re-raise
        if ctx.pipeline_run.sweep["run"] == 1:
            finish_pipeline(ctx, "FAILED", "RuntimeError: a bug")
            raise RuntimeError("a bug")
        return run_stages(ctx, retries=retries)

    monkeypatch.setattr(sweep_module, "run_stages", crash_the_first)
    trials = sweep_module.plan_sweep(
        "marin-535b-a23b", "tiny", {"data.max_bytes_per_domain": [150000, 130000]}, until="data"
    )
    sweep_module.run_sweep(trials, options=RunOptions(), hooks_for=lambda t: PipelineHooks(), at_once=1)
    first, second = trials
    assert (first.state, first.why) == ("FAILED", "RuntimeError: a bug")
    assert second.state == "COMPLETED"
    with LineageStore.open() as store:
        assert store.require(PipelineRun, first.pipeline_run_id).state == "FAILED"


def test_a_sweep_that_requires_its_issue_starts_no_job_without_the_link(run_cli, openlab_home: Path) -> None:
    """`--require-issue` as `run` has it: with no GitHub token, each run stops before any job starts."""
    env = {"GITHUB_TOKEN": ""}
    done = run_cli(
        *ARGS, "-g", "data.max_bytes_per_domain=150000,130000", "--issue", "lab/exp#1", "--require-issue", env=env
    )
    assert done.returncode == 1, done.stderr
    for number in (1, 2):
        assert (
            f"run {number} (data.max_bytes_per_domain=" in done.stderr and "the issue link is required" in done.stderr
        )
    with LineageStore.open() as store:
        assert store.list(Attempt) == []  # no job was started
