"""A local job's attempt records what the job used: its largest process's peak resident memory and
the CPU time of it and every process it waited for (the supervisor is the job's parent: wait4)."""

from __future__ import annotations

import sys

from orchestrator.launchers import JobSpec, JobState, get_launcher
from orchestrator.launchers.attempts import run_job
from orchestrator.lineage import Attempt, LineageStore

#: Touches 256 MiB (so it is resident) and burns 0.6 s of CPU.
HUNGRY = (
    "import time\n"
    "b = bytearray(256 * 2**20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 0.6: pass\n"
)


def test_a_local_job_records_its_peak_memory_and_cpu_time(store: LineageStore) -> None:
    launcher = get_launcher("local")
    attempt, status = run_job(store, launcher, JobSpec(name="hungry", command=[sys.executable, "-c", HUNGRY]))
    assert status.state is JobState.SUCCEEDED, status
    used = store.require(Attempt, attempt.id).used
    assert used is not None and used["max_rss_bytes"] >= 256 * 2**20, used
    assert used["cpu_seconds"] >= 0.6, used

    # two tasks: the runner waits for both, so the CPU time is theirs together
    attempt, status = run_job(
        store, launcher, JobSpec(name="hungry2", command=[sys.executable, "-c", HUNGRY], tasks_per_node=2)
    )
    assert status.state is JobState.SUCCEEDED, status
    used = store.require(Attempt, attempt.id).used
    assert used is not None and used["cpu_seconds"] >= 1.2 and used["max_rss_bytes"] >= 256 * 2**20, used
