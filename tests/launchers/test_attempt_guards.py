"""What `run_job` guards before and while a job runs: a stage run that is not there, a job's own
secrets, and a backend that cannot be asked for a while (a controller restarting)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from orchestrator.errors import OpenlabError
from orchestrator.launchers import BackendUnavailable, JobHandle, JobSpec, JobState, JobStatus, get_launcher
from orchestrator.launchers.attempts import run_job
from orchestrator.launchers.local import LocalLauncher
from orchestrator.lineage.models import Attempt
from orchestrator.lineage.store import LineageStore
from tests.launchers.test_launchers_faults import cli


def test_an_attempt_for_a_stage_run_lineage_does_not_hold_is_refused_before_the_job_runs(
    store: LineageStore, tmp_path: Path
) -> None:
    """The job ran, its attempt could not be recorded (a foreign key), and it went on unseen: no
    attempt, nothing in `job list`, and an error that blamed the database."""
    marker = tmp_path / "ran"
    proc = cli("job", "run", "-b", "local", "--stage-run", "srun_nosuch", "--", "touch", str(marker))
    assert proc.returncode == 2, proc.stderr
    said = proc.stderr.strip()
    assert said.startswith("error: no stage run 'srun_nosuch' in lineage: give the full id") and "\n" not in said, said
    assert not marker.exists(), "the job must not run"
    with pytest.raises(OpenlabError, match="no stage run 'srun_nosuch'"):
        run_job(
            store, get_launcher("local"), JobSpec(name="x", command=["touch", str(marker)]), stage_run_id="srun_nosuch"
        )
    assert not marker.exists() and store.list(Attempt) == []


def test_a_jobs_own_secret_is_masked_in_its_recorded_command(store: LineageStore) -> None:
    """``-e MY_PASSWORD=... -- tool --password ...``: the value is the job's, not this process's,
    so the store's own scrubbing could not know it; the command it recorded and exported kept it."""
    secret = "pwLIT77-not-real"
    attempt, status = run_job(
        store,
        get_launcher("local"),
        JobSpec(name="x", command=["echo", f"pw={secret}"], env={"MY_PASSWORD": secret}),
        on_log=lambda _line: None,
    )
    assert status.state is JobState.SUCCEEDED
    assert attempt.command == ["echo", "pw=***"]
    (recorded,) = store.list(Attempt)
    assert recorded.command == ["echo", "pw=***"]
    assert secret not in json.dumps([e.payload for e in store.events()])


def test_a_job_id_recorded_on_two_clusters_is_refused_naming_both(store: LineageStore) -> None:
    """Slurm numbers jobs per cluster: `job status 4711` with 4711 recorded on 'east' and on 'west'
    asked about the newest, whichever cluster it was; now it names both and asks for the attempt."""
    with store.transaction() as tx:
        east = tx.add(Attempt(backend="slurm", job_id="4711", cluster="east"))
        west = tx.add(Attempt(backend="slurm", job_id="4711", cluster="west"))
    for command in ("status", "logs", "cancel"):
        proc = cli("job", command, "4711")
        said = proc.stderr.strip()
        assert proc.returncode == 2 and "\n" not in said, (command, said)
        assert said.startswith("error: job id '4711' names 2 recorded jobs: "), said
        assert f"{east.id} (slurm job on cluster 'east'" in said and f"{west.id} (slurm job on cluster 'west'" in said
        assert said.endswith("give the attempt id (a job id means something only on its cluster)"), said


class _ControllerDown(LocalLauncher):
    """The local backend, unable to say anything of a job from ``down_from`` on, for ``down_for`` seconds
    (a slurmctld failing over: the job goes on, only its status cannot be read)."""

    down_for = 3.0

    def __init__(self, **config: object) -> None:
        super().__init__(config={"grace": 1, **config})
        self.down_from: float | None = None
        self.failed_looks = 0

    def status(self, handle: JobHandle) -> JobStatus:
        now = time.monotonic()
        if self.down_from is None:
            self.down_from = now
        if now - self.down_from < self.down_for:
            self.failed_looks += 1
            raise BackendUnavailable("scontrol show job failed: Unable to contact slurm controller")
        return super().status(handle)


def test_a_backend_that_cannot_be_asked_for_a_while_does_not_cost_the_job(store: LineageStore) -> None:
    """Four failed looks in a row (75 s of a slurmctld down) cancelled a healthy job and failed its stage."""
    launcher = _ControllerDown()
    attempt, status = run_job(store, launcher, JobSpec(name="x", command=["sh", "-c", "sleep 4; exit 0"]))
    assert launcher.failed_looks >= 2
    assert status.state is JobState.SUCCEEDED and attempt.state == "COMPLETED", (status, attempt.reason)


def test_a_backend_gone_for_longer_than_its_outage_grace_fails_the_attempt(store: LineageStore) -> None:
    launcher = _ControllerDown(outage_grace=1)  # [backends.NAME] outage_grace (default 900 s)
    assert _ControllerDown().outage_grace == 900
    launcher.down_for = 60.0
    with pytest.raises(
        BackendUnavailable, match=r"Unable to contact slurm controller \(for \d+ s, longer than outage_grace 1 s\)"
    ):
        run_job(store, launcher, JobSpec(name="x", command=["sleep", "60"]))
    (attempt,) = store.list(Attempt)
    assert attempt.state == "FAILED" and "Unable to contact" in (attempt.reason or ""), attempt.reason
