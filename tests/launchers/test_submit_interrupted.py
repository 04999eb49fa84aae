"""A submit cut short (Ctrl-C, SIGTERM) after the backend took the job leaves no job running.

The caller never learns the job's id, so lineage cannot record it and nobody can cancel it: a
container or Kubernetes Job left behind would train on, holding GPUs, with no record of who
started it. Each launcher removes what it made before the interruption goes on up. The
interruption is injected into the backend's own client call, just after the job was made.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from typing import Any

import pytest

from orchestrator.launchers import JobSpec
from orchestrator.launchers.kubernetes import k8s_name
from tests.launchers.harness import BACKENDS, Harness

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

        def replace(src: Any, dst: Any) -> None:
            if str(dst).endswith(".json") and "local-" in str(dst):
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
