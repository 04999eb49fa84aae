"""A submit cut short after the backend took the job leaves no job running.

The caller never learns the job's id, so lineage cannot record it and nobody can cancel it: a
container or Kubernetes Job left behind would train on, holding GPUs, with no record of who
started it. Cut short by Ctrl-C or SIGTERM, each launcher removes what it made before the
interruption goes on up (injected into the backend's own client call, just after the job was made).
Killed outright (SIGKILL: nothing of the submitter runs after), the attempt recorded before the
submit and the job's attempt label let the reaper find the job and stop it.
"""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from orchestrator.launchers import JobSpec
from orchestrator.launchers.base import ATTEMPT_LABEL
from orchestrator.launchers.kubernetes import k8s_name
from orchestrator.lineage.models import Attempt, StageRun
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline.reconcile import reconcile
from orchestrator.settings import load_settings
from tests.launchers.harness import BACKENDS, Harness
from tests.launchers.killed_submitter import run_killed_submitter

INTERRUPTIBLE = [p for p in BACKENDS if p.id in ("local", "docker", "kubernetes")]


def _left_over(harness: Harness, name: str, marker: str) -> list[str]:
    """Anything of the job named ``name`` (whose command carries ``marker``) still there."""
    if harness.name == "local":
        found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True, check=False)
        return [f"pid {pid}" for pid in found.stdout.split()]
    if harness.name == "docker":
        containers = harness.launcher.client.containers.list(  # type: ignore[attr-defined]
            all=True, filters={"label": f"openlab.io/job-name={name}"}
        )
        return [c.name for c in containers]
    if harness.name == "slurm":
        found = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i %T"], capture_output=True, text=True, check=False)
        return [line for line in found.stdout.splitlines() if line.strip()]
    cluster = harness.options["cluster"]
    prefix = k8s_name(name)[:-9]  # the name less its random suffix
    return (
        [f"Job {n}" for (_, n) in cluster.jobs() if n.startswith(prefix)]
        + [f"pod {n}" for (_, n) in cluster.pod_phases() if n.startswith(prefix)]
        + [f"Secret {n}" for (_, n) in cluster.secrets() if n.startswith(prefix)]
    )


def _interrupt_after_the_job_is_made(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the backend's call that makes the job succeed, then raise KeyboardInterrupt, as a Ctrl-C
    arriving while the answer comes back would."""
    if harness.name == "local":
        import os

        real_replace = os.replace

        def replace(src: Any, dst: Any) -> None:  # ID.json written again, with the started supervisor's pid
            if str(dst).endswith(".json") and "local-" in str(dst) and "supervisor_pid" in Path(src).read_text():
                raise KeyboardInterrupt
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
    elif harness.name == "docker":
        from docker.models.containers import Container

        real_start = Container.start

        def start(self: Container, **kwargs: Any) -> Any:
            real_start(self, **kwargs)
            raise KeyboardInterrupt

        monkeypatch.setattr(Container, "start", start)
    else:
        from kubernetes.client import BatchV1Api

        real_create = BatchV1Api.create_namespaced_job

        def create(self: BatchV1Api, *args: Any, **kwargs: Any) -> Any:
            real_create(self, *args, **kwargs)
            raise KeyboardInterrupt

        monkeypatch.setattr(BatchV1Api, "create_namespaced_job", create)


@pytest.mark.parametrize("harness", INTERRUPTIBLE, indirect=True)
def test_a_submit_interrupted_after_the_job_was_made_leaves_nothing_running(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"cut-short-{uuid.uuid4().hex[:6]}"
    marker = f"600.{uuid.uuid4().int % 10**6:06d}"  # a sleep no other job runs
    options = {k: v for k, v in harness.options.items() if k != "cluster"}
    job = JobSpec(
        name=name,
        command=["sleep", marker],
        image=harness.image,
        options=options,
        env={"WANDB_API_KEY": "not-a-real-key"},  # on Kubernetes: a Secret is made for it as well
    )
    _interrupt_after_the_job_is_made(harness, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        harness.launcher.submit(job)
    monkeypatch.undo()
    deadline = time.monotonic() + 15
    while (left := _left_over(harness, name, marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], f"{harness.name}: the interrupted submit left {left} behind"
    if harness.name == "kubernetes":  # and no pod of it was left to start without its ConfigMap or Secret
        assert not harness.options["cluster"].errors, harness.options["cluster"].errors


@pytest.mark.parametrize("harness", BACKENDS, indirect=True)
def test_a_job_whose_submitter_was_killed_is_found_and_stopped_by_the_reaper(
    harness: Harness, store: LineageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL right after the backend took the job: before, nothing was recorded, and the job ran on
    with nobody to record, time or cancel it; the reaper said the stage "ended before any job was
    submitted"."""
    name = f"killed-{uuid.uuid4().hex[:6]}"
    marker = f"600.{uuid.uuid4().int % 10**6:06d}"
    with store.transaction() as tx:
        run = tx.add(StageRun(stage="pretrain", identity=f"i-{name}", state="RUNNING"))  # no lease: its holder is gone
    given = {
        "backend": harness.name,
        "config": dict(harness.launcher.config),
        "name": name,
        "command": ["sleep", marker],
        "image": harness.image,
        "env": {"WANDB_API_KEY": "not-a-real-key"},  # on Kubernetes: a Secret is made for it as well
    }
    given["stage_run"] = run.id
    for key, value in given["config"].items():  # the reaper's launcher, from the settings, as the harness's
        monkeypatch.setenv(f"OPENLAB_BACKENDS__{harness.name.upper()}__{key.upper()}", str(value))
    child = run_killed_submitter(given)
    assert child.returncode == -signal.SIGKILL, child.stderr
    (attempt,) = store.list(Attempt, stage_run_id=run.id)
    assert (attempt.state, attempt.job_id) == ("PENDING", None)  # what the killed submitter left
    (handle,) = harness.launcher.find({ATTEMPT_LABEL: attempt.id})
    assert not harness.launcher.status(handle).state.terminal, "the job runs on, unrecorded"

    (done,) = reconcile(store, settings=load_settings())
    assert (done.stage_run_id, done.state, done.job_id) == (run.id, "CANCELLED", handle.job_id), done
    assert "orphaned" in done.reason
    attempt = store.require(Attempt, attempt.id)
    assert (attempt.job_id, attempt.state) == (handle.job_id, "CANCELLED")
    assert store.require(StageRun, run.id).state == "CANCELLED"
    deadline = time.monotonic() + harness.wait_timeout
    while (left := _left_over(harness, name, marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"{harness.name}: the reaped job left {left} behind"
    assert reconcile(store, settings=load_settings()) == []
