"""`openlab lineage usage`: what a month of jobs used and lost, from lineage alone.

The library on real SQLite and PostgreSQL (the `store` fixture); the command as a subprocess.
"""

from __future__ import annotations

import datetime as dt
import json

import pytest

from orchestrator.errors import ConfigError
from orchestrator.lineage import Attempt, LineageStore, PipelineRun, StageRun, utcnow
from orchestrator.lineage.listing import RecordFilter
from orchestrator.lineage.usage import usage

NOW = utcnow().replace(microsecond=0)
H = dt.timedelta(hours=1)


def _month(store: LineageStore) -> dict[str, str]:
    """A nightly whose pretrain was preempted once (2 h on 8 GPUs lost) then ran 3 h; a drop
    nightly on the CPU; an old run out of the window; a job still pending."""
    with store.transaction() as tx:
        night = tx.add(
            PipelineRun(recipe="marin", replica="small", backend="slurm", trigger="schedule", started_at=NOW - 6 * H)
        )
        pre = tx.add(StageRun(pipeline_run_id=night.id, stage="pretrain", identity="p", started_at=NOW - 6 * H))
        gpu = {"cpus": 16, "gpus": 8, "memory": "64G"}
        tx.add(
            Attempt(
                stage_run_id=pre.id,
                backend="slurm",
                state="PREEMPTED",
                resources=gpu,
                submitted_at=NOW - 6 * H,
                started_at=NOW - 6 * H,
                ended_at=NOW - 4 * H,
            )
        )
        tx.add(
            Attempt(
                stage_run_id=pre.id,
                number=2,
                backend="slurm",
                state="COMPLETED",
                resources=gpu,
                submitted_at=NOW - 4 * H,
                started_at=NOW - 4 * H,
                ended_at=NOW - 1 * H,
            )
        )
        data = tx.add(StageRun(pipeline_run_id=night.id, stage="data", identity="d", started_at=NOW - 7 * H))
        tx.add(
            Attempt(
                stage_run_id=data.id,
                backend="local",
                state="COMPLETED",  # asked for no CPU count: 1
                used={"cpu_seconds": 1800.0, "max_rss_bytes": 3 * 2**30},  # measured: half its CPU-hour
                submitted_at=NOW - 7 * H,
                started_at=NOW - 7 * H,
                ended_at=NOW - 6 * H,
            )
        )
        mid = tx.add(StageRun(pipeline_run_id=night.id, stage="midtrain", identity="m", started_at=NOW - H))
        tx.add(
            Attempt(
                stage_run_id=mid.id,
                backend="slurm",
                cluster="west",
                user="ada",
                state="COMPLETED",  # 2 nodes x 4 tasks, 2 CPUs per task and 8 GPUs per node: 16 CPUs, 16 GPUs
                resources={"cpus": 2, "gpus": 8, "nodes": 2, "tasks_per_node": 4},
                submitted_at=NOW - H,
                started_at=NOW - H,
                ended_at=NOW - H / 2,
            )
        )
        drops = tx.add(
            PipelineRun(
                recipe="marin",
                replica="drops",
                backend="local",
                started_at=NOW - 2 * H,
                params={"sweep": {"id": "swp_" + "d" * 20, "run": 1, "of": 3}},  # one run of a sweep
            )
        )
        repro = tx.add(StageRun(pipeline_run_id=drops.id, stage="repro", identity="r", started_at=NOW - 2 * H))
        tx.add(
            Attempt(
                stage_run_id=repro.id,
                backend="local",
                state="FAILED",
                resources={"cpus": 2},
                submitted_at=NOW - 2 * H,
                started_at=NOW - 2 * H,
                ended_at=NOW - H / 2,
            )
        )
        tx.add(
            Attempt(
                stage_run_id=repro.id,
                number=2,
                backend="local",
                state="PENDING",
                resources={"cpus": 2},
                submitted_at=NOW - H / 4,
            )
        )
        old = tx.add(PipelineRun(recipe="llama", replica="tiny", backend="local", started_at=NOW - 40 * 24 * H))
        old_stage = tx.add(StageRun(pipeline_run_id=old.id, stage="eval", identity="e", started_at=old.started_at))
        tx.add(
            Attempt(
                stage_run_id=old_stage.id,
                backend="local",
                state="COMPLETED",
                submitted_at=old.started_at,
                started_at=old.started_at,
                ended_at=old.started_at + 5 * H,
            )
        )
    return {"night": night.id}


def test_usage_sums_hours_and_what_was_asked_and_counts_the_lost(store: LineageStore) -> None:
    _month(store)
    report = usage(store, RecordFilter.from_options(since="30d"), by="replica")
    by = {g.group: g for g in report.groups}
    assert list(by) == ["marin:small", "marin:drops"], "largest first; the old run is out of the window"
    small, drops = by["marin:small"], by["marin:drops"]
    assert (small.attempts, small.wall_hours) == (4, pytest.approx(6.5))
    assert small.gpu_hours == pytest.approx(40.0 + 0.5 * 16), "GPUs per node x nodes"
    assert small.cpu_hours == pytest.approx(2 * 16 + 3 * 16 + 1 * 1 + 0.5 * 16), "CPUs per task x tasks"
    assert small.lost_hours == pytest.approx(2.0) and small.by_state == {"PREEMPTED": 1, "COMPLETED": 3}
    assert drops.lost_hours == pytest.approx(1.5) and drops.cpu_hours == pytest.approx(3.0)
    assert drops.by_state == {"FAILED": 1, "PENDING": 1}, "a job that has not started used nothing"
    assert report.total.wall_hours == pytest.approx(8.0) and report.total.lost_hours == pytest.approx(3.5)
    # what was used, beside what the same (measured) jobs asked for; unmeasured jobs count in neither
    assert (small.measured, small.cpu_hours_used, small.cpu_hours_asked_measured) == (1, 0.5, 1.0)
    assert small.peak_rss_bytes == 3 * 2**30 and drops.measured == 0 and drops.peak_rss_bytes is None

    stages = {g.group: g.gpu_hours for g in usage(store, RecordFilter.from_options(recipe="marin"), by="stage").groups}
    assert stages == {"pretrain": pytest.approx(40.0), "midtrain": pytest.approx(8.0), "repro": 0.0, "data": 0.0}
    preempted = usage(store, RecordFilter.from_options(state=["PREEMPTED"]), by="backend")
    assert [(g.group, g.lost_hours) for g in preempted.groups] == [("slurm", pytest.approx(2.0))]
    clusters = {
        g.group: g.wall_hours for g in usage(store, RecordFilter.from_options(recipe="marin"), by="cluster").groups
    }
    assert clusters["slurm@west"] == pytest.approx(0.5), clusters  # which cluster the hours went to
    assert "local@(not recorded)" in clusters, "an attempt recorded before clusters were still counts"
    users = {g.group: g.gpu_hours for g in usage(store, RecordFilter.from_options(recipe="marin"), by="user").groups}
    assert users == {"ada": pytest.approx(8.0), "(not recorded)": pytest.approx(40.0)}, users  # as sreport's per user
    assert [g.group for g in usage(store, RecordFilter.from_options(user="ada"), by="stage").groups] == ["midtrain"]
    triggers = {
        g.group: g.gpu_hours for g in usage(store, RecordFilter.from_options(recipe="marin"), by="trigger").groups
    }
    assert triggers == {"schedule": pytest.approx(48.0), "(not recorded)": 0.0}, triggers  # the nightly's GPU-hours
    sweeps = {g.group: g.attempts for g in usage(store, RecordFilter.from_options(recipe="marin"), by="sweep").groups}
    assert sweeps["swp_" + "d" * 20] == 2 and "(no sweep)" in sweeps, sweeps  # what a sweep cost, beside the rest
    (only,) = usage(store, RecordFilter.from_options(sweep="swp_ddd"), by="stage").groups
    assert (only.group, only.attempts) == ("repro", 2)  # its failed job and the retry
    with pytest.raises(ConfigError, match="cannot group usage by 'team': use one of: recipe, replica"):
        usage(store, by="team")


def test_a_chain_of_jobs_that_each_saved_and_went_on_lost_nothing(store: LineageStore) -> None:
    """A pretraining longer than the cluster's 24 h cap runs as a chain: each job is stopped by the
    limit (or preempted) after saving its checkpoint, and the next goes on from it. Those hours were
    not lost; a job that ran out of time without saving anything was."""
    with store.transaction() as tx:
        run = tx.add(PipelineRun(recipe="marin", replica="hero", backend="slurm", started_at=NOW - 60 * H))
        pre = tx.add(StageRun(pipeline_run_id=run.id, stage="pretrain", identity="p", started_at=NOW - 60 * H))
        for number, (state, saved, start, hours) in enumerate(
            [
                ("FAILED", True, 60, 24),
                ("PREEMPTED", True, 36, 10),
                ("FAILED", None, 26, 1),
                ("COMPLETED", None, 25, 20),
            ],
            1,
        ):
            tx.add(
                Attempt(
                    stage_run_id=pre.id,
                    number=number,
                    backend="slurm",
                    state=state,
                    progress_saved=saved,
                    resources={"gpus": 8},
                    submitted_at=NOW - start * H,
                    started_at=NOW - start * H,
                    ended_at=NOW - (start - hours) * H,
                )
            )
    (hero,) = usage(store, by="replica").groups
    assert hero.wall_hours == pytest.approx(55.0) and hero.gpu_hours == pytest.approx(440.0)
    assert hero.lost_hours == pytest.approx(1.0), "only the job that saved nothing"
    with LineageStore.open() as again:  # the field is stored, not only held in memory
        assert sorted(str(a.progress_saved) for a in again.list(Attempt)) == ["None", "None", "True", "True"]


def test_the_command_prints_the_table_and_json(run_cli, openlab_home) -> None:
    from orchestrator.lineage import open_store

    with open_store() as store:
        _month(store)
    out = run_cli("lineage", "usage", "--since", "30d", "--by", "stage", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["by"] == "stage" and data["total"]["gpu_hours"] == pytest.approx(48.0)
    table = run_cli("lineage", "usage", "--replica", "small", env={"COLUMNS": "200"})
    assert table.returncode == 0 and "job usage by recipe" in table.stdout, table.stdout
    assert "1 completed" not in table.stdout and "3 completed 1 preempted" in table.stdout, table.stdout
    assert " 6.50 " in table.stdout, table.stdout  # the nightly's wall hours
    assert "0.50 of 1.00" in table.stdout and "3.00 GiB" in table.stdout, table.stdout  # used, of asked
    # in an 80-column terminal (and a pipe, which rich takes as 80) a block per group: its name whole,
    # each figure named, no number cut
    narrow = run_cli("lineage", "usage", "--replica", "small", env={"COLUMNS": "80"})
    lines = narrow.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in narrow.stdout, narrow.stdout
    assert "marin  4 jobs: 3 completed 1 preempted" in lines, narrow.stdout
    assert "    wall 6.50 h · CPU " in narrow.stdout, narrow.stdout
    assert "    measured: CPU 0.50 h used of 1.00 h asked · peak memory 3.00 GiB" in lines, narrow.stdout
    assert run_cli("lineage", "usage", "--recipe", "marin-535b-a23b").stdout.strip() == "no jobs match"
    typo = run_cli("lineage", "usage", "--recipe", "marn")  # a misspelt name is not "nothing used"
    assert typo.returncode == 2 and "did you mean 'marin'?" in typo.stderr, typo.stderr
    bad = run_cli("lineage", "usage", "--by", "team")
    assert bad.returncode == 2 and "cannot group usage by 'team'" in bad.stderr and "Traceback" not in bad.stderr


def test_small_hours_read_as_decimals_not_scientific_notation() -> None:
    from orchestrator.cli.lineage import _hours

    assert [_hours(v) for v in (0, 6e-05, 0.0123, 0.1, 2.5)] == ["0.00", "0.000060", "0.012", "0.10", "2.50"]
