"""Pipeline runs linked to experiment issues, recorded as a pipeline start records them, for the
digest tests (tests/links/test_links_digest.py, tests/flows/test_digest_flow.py)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from orchestrator.lineage.models import Attempt, Commit, GithubIssue, PipelineRun, StageRun, WandbRun
from orchestrator.lineage.store import LineageStore

#: The end of the window most digest tests use, and its UTC day.
NOW = dt.datetime(2026, 12, 5, 7, 0, tzinfo=dt.UTC)
DAY = "2026-12-05"
H = dt.timedelta(hours=1)


def record_run(
    store: LineageStore,
    run_id: str,
    issue: str,
    *,
    started: dt.datetime,
    ended: dt.datetime | None,
    state: str,
    stages: dict[str, str] | None = None,
    error: str | None = None,
    metrics: dict[str, Any] | None = None,
    preregistration: dict[str, Any] | None = None,
    verdict: dict[str, Any] | None = None,
    gpus: int = 1,
    trigger: str | None = None,
    user: str | None = None,
    params: dict[str, Any] | None = None,
) -> PipelineRun:
    """A pipeline run linked to ``issue`` as a pipeline start links it: a commit, stage runs with one
    job each (1 h, ``gpus`` GPUs asked), the last stage's metrics, a W&B run on the first stage."""
    stages = stages or {"pretrain": "COMPLETED", "eval": "COMPLETED"}
    with store.transaction() as tx:
        repo, _, number = issue.partition("#")
        gh = tx.get(GithubIssue, issue) or tx.add(GithubIssue(id=issue, repo=repo, number=int(number)))
        run = tx.add(
            PipelineRun(
                id=run_id,
                recipe="marin-535b-a23b",
                replica="tiny",
                backend="slurm",
                trigger=trigger,
                user=user,
                state=state,
                started_at=started,
                ended_at=ended,
                preregistration=preregistration,
                verdict=verdict,
                params=params or {},
            )
        )
        commit = tx.get(Commit, "c0ffee1234567890") or tx.add(
            Commit(
                id="c0ffee1234567890",
                sha="c0ffee1234567890",
                remote_url="git@github.com:lab/exp.git",
                message="moe: quantile-balancing bias update\n\nlong body",
            )
        )
        tx.relate("wasAssociatedWith", run, commit)
        tx.relate("wasAssociatedWith", run, gh)
        names = list(stages)
        for i, (name, stage_state) in enumerate(stages.items()):
            srun = tx.add(
                StageRun(
                    id=f"{run_id}-{name}",
                    pipeline_run_id=run.id,
                    stage=name,
                    identity=f"{run_id}{name}".ljust(64, "0"),
                    state=stage_state,
                    error=error if stage_state == "FAILED" else None,
                    metrics=(metrics or {}) if name == names[-1] else {},
                    started_at=started + dt.timedelta(minutes=i),
                )
            )
            ended_job = started + H if stage_state != "RUNNING" else None
            tx.add(
                Attempt(
                    stage_run_id=srun.id,
                    backend="slurm",
                    job_id=f"{run_id}-{i}",
                    state="FAILED" if stage_state == "FAILED" else stage_state,
                    started_at=started,
                    ended_at=ended_job,
                    resources={"gpus": gpus, "cpus": 2},
                )
            )
            if i == 0:
                wb = tx.add(
                    WandbRun(
                        id=f"lab/openlab/{run_id}w",
                        run_id=f"{run_id}w",
                        project="openlab",
                        mode="online",
                        url=f"https://wandb.ai/lab/openlab/runs/{run_id}w",
                    )
                )
                tx.relate("wasAssociatedWith", srun, wb)
    return run


def prereg(actual: float, outcome: str) -> dict[str, Any]:
    check = {
        "metric": "eval/code/loss",
        "stage": "eval",
        "predicted": 5.3,
        "tolerance": 0.4,
        "actual": actual,
        "outcome": outcome,
    }
    return {"checks": [{**check, "error": actual - 5.3}], "decided_at": NOW.isoformat()}
