"""A real Slurm preemption: a job in a higher-priority partition takes the node from a running stage.

The test cluster (infra/slurm/start.sh) has an ``urgent`` partition whose jobs preempt those of
``debug`` and ``batch`` (``PreemptType=preempt/partition_prio``, ``PreemptMode=CANCEL``): the
preempted job is sent SIGTERM, ends in Slurm's PREEMPTED state, and is not requeued by Slurm.
openlab must record that attempt PREEMPTED (not FAILED) and run the stage again, with no retries.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from orchestrator.lineage.models import Attempt, StageRun
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline import PipelineHooks, RunOptions, run_stages, start_pipeline
from orchestrator.pipeline.dag import REPO_ROOT, Pipeline, StageSpec
from tests.services import require_slurm

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

#: The first attempt "trains" until it is preempted; the next one finds its marker and finishes.
SPOT = (
    "import pathlib, sys, time; out = pathlib.Path(sys.argv[1]); m = out.parent / 'started-once';"
    "first = not m.exists(); m.touch(); print('training' if first else 'resumed', flush=True);"
    "first and time.sleep(240); out.mkdir(parents=True, exist_ok=True); (out / 'done').write_text('ok')"
)


def test_a_stage_preempted_by_a_higher_priority_slurm_job_runs_again(tmp_path: Path) -> None:
    require_slurm()
    spec = StageSpec(
        name="spot",
        command=(sys.executable, "-c", SPOT, "{out}"),
        backend_options={"slurm": {"extra_args": ["--exclusive"]}},  # the whole node: another job must preempt it
    )
    pipeline = Pipeline(name="preempted-on-slurm", stages=(spec,), repo_root=REPO_ROOT)
    urgent: list[str] = []

    def take_the_node(stage: str, line: str) -> None:  # once the stage's job runs (its first line)
        if line == "training" and not urgent:
            done = subprocess.run(
                [
                    "sbatch",
                    "--parsable",
                    "--partition=urgent",
                    "--cpus-per-task=1",
                    "--job-name=urgent",
                    f"--output={tmp_path}/urgent-%j.log",
                    "--wrap",
                    "echo urgent work",
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            urgent.append(done.stdout.strip())

    seen: list[tuple[str, str]] = []
    hooks = PipelineHooks(
        on_log=lambda stage, line: threading.Thread(target=take_the_node, args=(stage, line)).start(),
        on_transition=lambda e: seen.append((e.stage, e.state)),
    )
    ctx = start_pipeline(pipeline, {"spot": {"n": 1}}, options=RunOptions(backend="slurm", poll=1.0), hooks=hooks)
    result = run_stages(ctx, retries=0)
    assert urgent, "the urgent job was submitted while the stage ran"
    assert result.state == "COMPLETED", result.error
    assert ("spot", "PREEMPTED") in seen
    with LineageStore.open() as store:
        (stage,) = store.list(StageRun, pipeline_run_id=result.pipeline_run.id)
        first, second = store.list(Attempt, stage_run_id=stage.id, order_by=Attempt.number)
        assert first.state == "PREEMPTED" and first.reason == "preempted by a higher-priority job", first
        assert second.state == "COMPLETED" and second.job_id != first.job_id
    state = subprocess.run(["scontrol", "show", "job", "-o", first.job_id], capture_output=True, text=True).stdout
    assert "JobState=PREEMPTED" in state, "Slurm itself says the first job was preempted"
