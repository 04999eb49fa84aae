"""Lineage cards: markdown for a pipeline run and a stage run, from lineage records only."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from orchestrator.cards import commit_url, pipeline_card, stage_card
from orchestrator.lineage.models import Attempt, GithubIssue, PipelineRun, StageRun, WandbRun


@pytest.mark.parametrize(
    ("remote", "expected"),
    [
        ("git@github.com:lab/exp.git", "https://github.com/lab/exp/commit/abc"),
        ("https://github.com/lab/exp", "https://github.com/lab/exp/commit/abc"),
        ("https://user:s3cret@github.com/lab/exp.git", "https://github.com/lab/exp/commit/abc"),
        ("ssh://git@github.com/lab/exp.git", "https://github.com/lab/exp/commit/abc"),
        ("git@gitlab.com:lab/exp.git", None),
        ("/local/path/repo", None),
        (None, None),
    ],
)
def test_commit_url(remote: str | None, expected: str | None) -> None:
    assert commit_url(remote, "abc") == expected


def test_enterprise_host_gets_links_when_named() -> None:
    assert commit_url("git@ghe.corp:a/b.git", "abc") is None
    assert commit_url("git@ghe.corp:a/b.git", "abc", ("github.com", "ghe.corp")) == "https://ghe.corp/a/b/commit/abc"


def test_pipeline_card_shows_every_link(store, pipeline) -> None:
    with store.transaction() as tx:
        run = tx.get(PipelineRun, pipeline.id)
        prereg = {
            "checks": [
                {
                    "metric": "eval|loss",
                    "stage": "eval",
                    "predicted": 2.2,
                    "tolerance": 0.1,
                    "actual": 2.25,
                    "outcome": "met",
                    "error": 0.05,
                }
            ]
        }
        tx.update(run, state="COMPLETED", verdict={"status": "regressed", "loss_delta": 0.0312}, preregistration=prereg)
        tx.update(tx.get(StageRun, "srun_train"), state="COMPLETED", metrics={"eval|loss": 2.25})
        # a proxy's error page in a stage's error: raw, its "<!--" made the rest of the card a comment
        tx.update(tx.get(StageRun, "srun_tok"), error="upload failed: 502 <!-- nginx --> <html>bad gateway")
        tx.update(
            tx.get(WandbRun, "/openlab/w1234567"), url="https://wandb.ai/lab/openlab/runs/w1234567", state="failed"
        )
        issue = tx.add(GithubIssue(id="lab/exp#7", repo="lab/exp", number=7, url="https://github.com/lab/exp/issues/7"))
        tx.relate("wasAssociatedWith", run, issue)
    card = pipeline_card(store, pipeline.id)
    for needle in [
        "`prun_test0001`: nightly moe",
        "[`abc1234d`](https://github.com/lab/exp/commit/abc1234def567890) (dirty patch `9f8e7d6c5b4a`)",
        "`b3snapshot01`",
        "reused from `srun_older`",
        "`slurm:4242` on `marin-west`",  # which job on which cluster
        "[w1234567](https://wandb.ai/lab/openlab/runs/w1234567) failed",  # how it ended, when not finished
        "eval\\|loss=2.25",  # a pipe inside a cell is escaped
        "loss=2.5",
        "**Nightly verdict:** regressed",
        "- loss_delta: 0.0312",
        "**Pre-registered:**",
        "- eval\\|loss (eval): predicted 2.2 ± 0.1, measured 2.25 (+0.05): met",
        "[lab/exp#7](https://github.com/lab/exp/issues/7)",
        "upload failed: 502 &lt;!-- nginx --> &lt;html>bad gateway",  # reads as written, opens no HTML
    ]:
        assert needle in card, needle
    assert "<!--" not in card.split("\n", 1)[1] and "<html>" not in card
    assert "_step" not in card
    assert card == pipeline_card(store, pipeline.id)  # same records, same card


def test_stage_card_lists_attempts_and_all_metrics(store, pipeline) -> None:
    card = stage_card(store, "srun_train")
    assert "- attempt 1: `slurm` job `4242` on `marin-west` RUNNING" in card
    # what a job asked for and, where measured, what it used
    t0 = dt.datetime(2026, 12, 1, 4, 0, tzinfo=dt.UTC)
    with store.transaction() as tx:
        tx.add(
            Attempt(
                stage_run_id="srun_train",
                number=2,
                backend="local",
                job_id="local-1",
                state="COMPLETED",
                resources={"cpus": 8, "memory": "32G"},
                used={"cpu_seconds": 5400.0, "max_rss_bytes": 3 * 2**30},
                started_at=t0,
                ended_at=t0 + dt.timedelta(hours=1),
            )
        )
    card = stage_card(store, "srun_train")
    assert (
        "- attempt 2: `local` job `local-1` COMPLETED; asked 8 CPUs, 32G; used 1.50 CPUs on average, peak 3.00 GiB"
        in card
    )
    assert "| loss | 2.5 |" in card
    assert "offline `/runs/wandb/offline-run-x-w1234567`" in card
    assert "b" * 64 in card


def test_the_changes_a_nightly_verdict_lists_name_source_files_and_short_hashes(store) -> None:
    """The verdict artifact says what went in differently since the run it was judged against: per
    stage, a changed source file by name (not its two tree hashes), a changed input's content hash cut
    short, a config value as it was and is; stages with nothing changed on one line."""
    from orchestrator.cards import render_changes
    from orchestrator.identity import compute_identity
    from orchestrator.lineage.diff import diff_records

    tok = compute_identity("tokenize", {"vocab": 512}, code={"workloads/moe/tokenizing.py": "a" * 40})

    def pretrain(lr: float, source: str, tokens: str) -> Any:
        return compute_identity(
            "pretrain", {"lr": lr}, inputs={"tokens": tokens}, code={"workloads/moe/dispatch.py": source}
        )

    runs = []
    for lr, source, tokens in ((0.01, "b" * 40, "c" * 64), (0.02, "d" * 40, "e" * 64)):
        with store.transaction() as tx:
            run = tx.add(PipelineRun(recipe="r", replica="tiny", backend="local"))
            for ident in (tok, pretrain(lr, source, tokens)):
                tx.add(
                    StageRun(
                        pipeline_run_id=run.id,
                        stage=ident.stage,
                        identity=ident.digest,
                        identity_fields=ident.fields(),
                    )
                )
        runs.append(run)
    before, after = runs
    with store.transaction() as tx:  # a stage each run alone ran
        tx.add(StageRun(pipeline_run_id=after.id, stage="eval", identity="e"))
        tx.add(StageRun(pipeline_run_id=before.id, stage="data", identity="d"))
    lines = render_changes(diff_records(store, before, after), before.id, after.id)
    assert (
        lines[0] == f"**What went in differently** since `{before.id}` (`openlab lineage diff {before.id} {after.id}`):"
    )
    assert lines[2:] == [
        "- **pretrain**: source `workloads/moe/dispatch.py`; `config.lr` `0.01` → `0.02`; "
        f"`inputs.tokens` `{'c' * 12}` → `{'e' * 12}`",
        "- **eval**: only in this run",
        f"- **data**: only in `{before.id}`",
        "- unchanged: tokenize",
    ], lines


def test_the_changes_name_the_commits_that_changed_a_stages_source() -> None:
    """Beside a changed source file, the verdict names the commits between the two runs that
    touched it (from ``lineage diff``), the first three and how many more."""
    from orchestrator.cards import render_changes
    from orchestrator.lineage.diff import Section

    commits = [(f"{i}" * 40, f"dispatch: fix {i}") for i in range(1, 6)]
    section = Section("pretrain", [{"path": "code.workloads/moe/dispatch.py", "old": "a" * 40, "new": "b" * 40}])
    section.commits = commits
    (line,) = render_changes([section], "prun_a", "prun_b")[2:]
    assert line == (
        "- **pretrain**: source `workloads/moe/dispatch.py` (changed by `1111111` dispatch: fix 1, "
        "`2222222` dispatch: fix 2, `3333333` dispatch: fix 3 and 2 more)"
    ), line
    section.commits, section.undone = [], commits[:1]  # this run is on a commit before that fix
    (line,) = render_changes([section], "prun_a", "prun_b")[2:]
    assert (
        line
        == "- **pretrain**: source `workloads/moe/dispatch.py` (lacks `1111111` dispatch: fix 1, which `prun_a` had)"
    )


@pytest.mark.parametrize(
    ("trigger", "user", "automation", "said"),
    [
        ("terminal", "ada", None, "terminal, by `ada`"),
        ("adopt", "ada", None, "adopt, by `ada`"),
        ("prefect", "ada", None, "prefect, by `ada`"),  # a flow called in ada's own Python, no deployment
        # Prefect's open-source server has no user: the account is the one serving the flows
        ("ui", "svc", None, "ui, served by `svc`"),
        ("automation", "svc", "re-run on regression", 'automation "re-run on regression", served by `svc`'),
        ("schedule", None, None, "schedule"),  # recorded before accounts were
        (None, None, None, None),
    ],
)
def test_the_card_says_how_a_run_started_and_as_whom(
    trigger: str | None, user: str | None, automation: str | None, said: str | None
) -> None:
    from orchestrator.cards import how_started

    params = {"prefect": {"automation": automation}} if automation else {}
    assert how_started(PipelineRun(trigger=trigger, user=user, params=params)) == said
