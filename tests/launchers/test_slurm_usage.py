"""A Slurm job's attempt records what the job used, from the cluster's accounting (sacct): the job's
TotalCPU and the largest MaxRSS its steps sampled. Real single-node cluster with slurmdbd."""

from __future__ import annotations

import sys

import pytest

from orchestrator.launchers import JobSpec, JobState, get_launcher
from orchestrator.launchers.attempts import run_job
from orchestrator.launchers.slurm import parse_sacct_bytes, parse_sacct_duration
from orchestrator.lineage import Attempt, LineageStore
from tests.services import require_slurm_accounting

#: Touches 256 MiB (so it is resident) and burns 3 s of CPU: longer than one accounting sample (2 s).
HUNGRY = (
    "import time\n"
    "b = bytearray(256 * 2**20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 3: pass\n"
)


@pytest.mark.slurm
def test_a_slurm_job_records_what_sacct_says_it_used(store: LineageStore) -> None:
    require_slurm_accounting()
    launcher = get_launcher("slurm")
    attempt, status = run_job(
        store, launcher, JobSpec(name="hungry", command=[sys.executable, "-c", HUNGRY]), timeout=150
    )
    assert status.state is JobState.SUCCEEDED, status
    used = store.require(Attempt, attempt.id).used
    assert used is not None and used["cpu_seconds"] >= 3.0, used
    assert 256 * 2**20 <= used["max_rss_bytes"] < 2**30, used


def test_sacct_numbers_are_read_in_its_own_units() -> None:
    assert parse_sacct_bytes("277080K") == 277080 * 1024
    assert parse_sacct_bytes("1.5G") == int(1.5 * 2**30)
    assert parse_sacct_bytes("512") == 512
    assert parse_sacct_bytes("") is None
    assert parse_sacct_duration("00:01.731") == pytest.approx(1.731)
    assert parse_sacct_duration("01:02:03") == 3723
    assert parse_sacct_duration("2-01:02:03") == 2 * 86400 + 3723
    assert parse_sacct_duration("") is None
