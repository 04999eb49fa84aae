"""A submitter SIGKILLed just after the backend took its job (run as a program by the tests).

``python -m tests.launchers.killed_submitter SPEC_JSON``: records an attempt for a stage run and
submits a job through :func:`~orchestrator.launchers.attempts.submit_attempt`, and kills itself with
SIGKILL right after the backend's own call that makes the job returns, before the launcher or the
caller can do anything more: what the OOM killer, a lost login node or ``kill -9`` does. Only the
kill is added; the submit, the store and the backend are the real ones.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from orchestrator.launchers.attempts import submit_attempt
from orchestrator.launchers.base import JobSpec, get_launcher
from orchestrator.lineage.store import open_store


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_after(owner: Any, name: str) -> None:
    real = getattr(owner, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        _die()

    setattr(owner, name, call)


def _kill_once_the_job_is_made(backend: str) -> None:
    if backend == "local":
        from orchestrator.launchers.local import LocalLauncher

        real = LocalLauncher._write_state

        def write(path: Any, state: dict[str, Any]) -> None:
            if "supervisor_pid" in state:  # the supervisor runs the job; its pid is not yet in ID.json
                _die()
            real(path, state)

        LocalLauncher._write_state = staticmethod(write)  # type: ignore[method-assign]
    elif backend == "docker":
        from docker.models.containers import Container

        _kill_after(Container, "start")
    elif backend == "slurm":
        from orchestrator.launchers.slurm import SlurmLauncher

        _kill_after(SlurmLauncher, "_sbatch")
    else:
        from kubernetes.client import BatchV1Api

        _kill_after(BatchV1Api, "create_namespaced_job")


def run_killed_submitter(given: dict[str, Any], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run this program on ``given`` (backend, config, name, command, image, env, stage_run) from the
    repository root, as the tests do; its return code is -SIGKILL when the kill was reached."""
    return subprocess.run(
        [sys.executable, "-m", "tests.launchers.killed_submitter", json.dumps(given)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def main(argv: list[str]) -> int:
    given = json.loads(argv[0])
    _kill_once_the_job_is_made(given["backend"])
    launcher = get_launcher(given["backend"], **given["config"])
    spec = JobSpec(name=given["name"], command=given["command"], image=given["image"], env=given["env"])
    with open_store() as store:
        submit_attempt(store, launcher, spec, stage_run_id=given["stage_run"])
    print("the submit returned: the kill was not reached", file=sys.stderr)
    return 3


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
