"""A Slurm job's attempt records what the job used: measured by the usage wrapper the batch script
runs it under (exact, with or without accounting), else from the cluster's accounting (sacct): the
job's TotalCPU and the largest MaxRSS its steps sampled. Real single-node cluster (with slurmdbd
for the sacct test; ``sacct = false`` is a cluster whose accounting openlab does not ask)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from orchestrator.launchers import JobSpec, JobState, get_launcher
from orchestrator.launchers.attempts import run_job
from orchestrator.launchers.slurm import parse_sacct_bytes, parse_sacct_duration
from orchestrator.lineage import Attempt, LineageStore
from tests.services import require_slurm, require_slurm_accounting

#: Touches 256 MiB (so it is resident) and burns 3 s of CPU: longer than one accounting sample (2 s).
HUNGRY = (
    "import time\n"
    "b = bytearray(256 * 2**20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 3: pass\n"
)


#: Touches 256 MiB and burns 0.5 s: shorter than one accounting sample, so sacct would see no memory.
QUICK = (
    "import os, time\n"
    "b = bytearray(256 * 2**20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 0.5: pass\n"
    "print('rank', os.environ.get('RANK', '-'), 'done', flush=True)\n"
)


def counting(sig: str, word: str, after: float, end: str) -> str:
    """A job that says ``<word> N`` for each ``sig`` it gets, and runs ``end`` ``after`` seconds
    after the first (time for a second one to arrive and be counted)."""
    return f"""
import signal, sys, time
got = []
signal.signal(signal.{sig}, lambda *_: got.append(1) or print("{word}", len(got), flush=True))
print("ready", flush=True)
start = time.time()
while not got and time.time() - start < 60:
    time.sleep(0.05)
time.sleep({after})
{end}
"""


#: Counts the SIGTERMs it gets and ends 1.5 s after the first, as a job that saves on a stop.
STOPS = counting("SIGTERM", "got SIGTERM", 1.5, "sys.exit(143)")


@pytest.mark.slurm
def test_a_slurm_job_records_what_sacct_says_it_used(store: LineageStore) -> None:
    require_slurm_accounting()
    launcher = get_launcher("slurm", measure_usage=False)  # sacct's numbers alone
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


@pytest.mark.slurm
def test_without_accounting_the_wrapper_measures_each_task_exactly(store: LineageStore) -> None:
    """The batch script runs the command (each task's) under the usage wrapper with the node's
    python3, so a cluster without slurmdbd records what a job used, and a job shorter than one
    accounting sample still has its peak memory. Tasks' CPU adds up; the peak is the largest one's."""
    require_slurm()
    launcher = get_launcher("slurm", sacct=False)
    lines: list[str] = []
    attempt, status = run_job(
        store, launcher, JobSpec(name="quick", command=[sys.executable, "-c", QUICK]), on_log=lines.append, timeout=150
    )
    assert status.state is JobState.SUCCEEDED and "rank - done" in lines, (status, lines)
    used = store.require(Attempt, attempt.id).used
    assert used is not None and used["cpu_seconds"] >= 0.5, used
    assert 256 * 2**20 <= used["max_rss_bytes"] < 512 * 2**20, used

    spec = JobSpec(name="quick2", command=[sys.executable, "-c", QUICK], tasks_per_node=2)
    attempt, status = run_job(store, launcher, spec, on_log=lines.append, timeout=150)
    assert status.state is JobState.SUCCEEDED, (status, lines)
    used = store.require(Attempt, attempt.id).used
    assert used is not None and used["cpu_seconds"] >= 1.0, used  # both tasks'
    assert 256 * 2**20 <= used["max_rss_bytes"] < 512 * 2**20, used  # the larger task's, not the sum

    # "auto" with no such Python on the node: the command runs as it is, unmeasured
    missing = get_launcher("slurm", sacct=False, python="no-such-python3")
    attempt, status = run_job(store, missing, JobSpec(name="bare", command=["true"]), timeout=150)
    assert status.state is JobState.SUCCEEDED and store.require(Attempt, attempt.id).used is None, status
    # measure_usage = true asks for it: the job fails as a missing command does
    forced = get_launcher("slurm", sacct=False, python="no-such-python3", measure_usage=True)
    _, status = run_job(store, forced, JobSpec(name="forced", command=["true"]), timeout=150)
    assert status.state is JobState.FAILED and status.exit_code == 127, status
    hint = "to run openlab's helper scripts with: set the slurm backend's python option to its Python"
    assert f"the node has no 'no-such-python3' {hint}" in (status.reason or ""), status
    # a job's own python option, which the status reads back from the job's batch script
    own = JobSpec(name="own", command=["true"], options={"python": "no-such-python3b", "measure_usage": True})
    _, status = run_job(store, get_launcher("slurm", sacct=False), own, timeout=150)
    assert f"the node has no 'no-such-python3b' {hint}" in (status.reason or ""), status


@pytest.mark.slurm
def test_a_cancelled_slurm_job_under_the_wrapper_is_told_once_and_its_use_kept() -> None:
    """Slurm signals every process of the step: the wrapper outlives the SIGTERM without passing it
    on (the command got its own), so the job saves on its one SIGTERM and what it used is kept."""
    require_slurm()
    launcher = get_launcher("slurm", sacct=False)
    handle = launcher.submit(JobSpec(name="stops", command=[sys.executable, "-c", STOPS]))
    try:
        deadline = time.monotonic() + 60
        while "ready" not in list(launcher.logs(handle)) and time.monotonic() < deadline:
            time.sleep(0.1)
        launcher.cancel(handle)
    finally:
        launcher.cleanup(handle)
    deadline = time.monotonic() + 10  # the job ends 1.5 s after its SIGTERM; the record follows
    while launcher.status(handle).usage is None and time.monotonic() < deadline:
        time.sleep(0.2)
    told = [line for line in launcher.logs(handle) if "got SIGTERM" in line]
    assert told == ["got SIGTERM 1"], list(launcher.logs(handle))
    status = launcher.status(handle)
    assert status.state is JobState.CANCELLED and status.usage is not None, status


@pytest.mark.parametrize(
    "how", ["a warning for the batch shell", "Slurm ends the job", "Slurm ends the job, TERM handled first"]
)
def test_the_batch_shells_wrapper_passes_on_a_warning_and_not_slurms_end_of_the_job(how: str, tmp_path: Path) -> None:
    """The wrapper a one-task job is exec'd under (``--slurm-batch``), signalled as Slurm does it,
    without a cluster: a warning comes to it alone and is passed on; Slurm's end of a job (a
    cancel, a time limit: SIGCONT then SIGTERM to every process, the command included) is not
    passed on, whichever of the two the wrapper's Python handles first. Told once either way."""
    import signal
    import subprocess

    from orchestrator.launchers.base import helper_script

    record = tmp_path / "usage.json"
    wrapper = [sys.executable, "-I", "-S", str(helper_script("usage.py")), "--slurm-batch", str(record), "--"]
    proc = subprocess.Popen([*wrapper, sys.executable, "-c", STOPS], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    command = int(subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()[0])
    if how == "a warning for the batch shell":
        os.kill(proc.pid, signal.SIGTERM)
    else:  # every process of the job, as slurmstepd does it
        order = [signal.SIGCONT, signal.SIGTERM]
        for pid in (proc.pid, command):
            for sig in order if how == "Slurm ends the job" else order[::-1]:
                os.kill(pid, sig)
    out, _ = proc.communicate(timeout=30)
    assert [line for line in out.splitlines() if "SIGTERM" in line] == ["got SIGTERM 1"], out
    assert proc.returncode == 143 and record.exists(), (proc.returncode, out)


def warned(sig: str) -> str:
    """Says when it is warned (``sig``), and ends normally 3 s after, as a job that saves on the warning."""
    return counting(sig, "warned", 3, 'print("saved and done", flush=True)')


@pytest.mark.slurm
@pytest.mark.parametrize("sig", ["USR1", "TERM"])
@pytest.mark.parametrize("measure_usage", [True, False], ids=["under the wrapper", "not measured"])
def test_a_warning_for_the_batch_shell_reaches_a_one_task_job_once(measure_usage: bool, sig: str) -> None:
    """``--signal=B:USR1@300`` or ``B:TERM@120`` (Slurm's warning before the time limit, for the
    batch shell alone) and ``scancel --batch -s USR1`` signal only the batch script's own process.
    That was bash, which has no USR1 handler: it died of it, the job ended FAILED (signal 10) and
    the training never heard the warning. The job is now that process (exec'd, under the wrapper
    or alone). Under the wrapper a TERM was not passed on at all (a cancel's TERM reaches the
    command itself); the wrapper now tells the two apart by the SIGCONT Slurm sends before
    ending a job (the cancel test above checks the other half: told once)."""
    import subprocess

    require_slurm()
    launcher = get_launcher("slurm", sacct=False, measure_usage=measure_usage)
    handle = launcher.submit(JobSpec(name="warned", command=[sys.executable, "-c", warned(f"SIG{sig}")]))
    try:
        deadline = time.monotonic() + 60
        while "ready" not in list(launcher.logs(handle)) and time.monotonic() < deadline:
            time.sleep(0.1)
        subprocess.run(["scancel", "--batch", f"--signal={sig}", handle.job_id], check=True, env=launcher._env())
        status = launcher.wait(handle, timeout=60)
    finally:
        launcher.cleanup(handle)
    lines = list(launcher.logs(handle))
    assert [line for line in lines if line.startswith("warned")] == ["warned 1"], lines
    assert "saved and done" in lines, lines
    assert status.state is JobState.SUCCEEDED and status.exit_code == 0, status
    assert (status.usage is not None) is measure_usage, status


@pytest.mark.slurm
@pytest.mark.parametrize("env", [{}, {"MY_TOKEN": "s3cret-value-42"}], ids=["under the wrapper", "output masked"])
def test_slurms_own_time_limit_warning_reaches_the_job_under_the_wrapper(env: dict[str, str]) -> None:
    """``--signal=B:USR1@N`` as Slurm itself sends it ahead of the time limit: with a SIGCONT of its own
    a few milliseconds after the USR1 (Slurm 22.05). The wrapper held the USR1 against that SIGCONT,
    took it for Slurm ending the job, and dropped it: no training stage was ever warned before its
    limit on Slurm, and each lost what it had not saved (``scancel --batch``, above, sends no SIGCONT)."""
    require_slurm()
    launcher = get_launcher("slurm", sacct=False)
    # warned 20 s in: long after the job has set its handler, even on a loaded machine (at 5 s, a Python slow
    # to start under load was killed by the USR1 it had no handler for yet, before it printed a line)
    spec = JobSpec(
        name="limited",
        command=[sys.executable, "-c", warned("SIGUSR1")],
        time_limit=120,
        warn_before_limit=100,
        env=env,
    )
    handle = launcher.submit(spec)
    try:
        status = launcher.wait(handle, timeout=180)
    finally:
        launcher.cleanup(handle)
    lines = list(launcher.logs(handle))
    assert "ready" in lines, (status, lines)
    assert [line for line in lines if line.startswith("warned")] == ["warned 1"], lines
    assert "saved and done" in lines and status.state is JobState.SUCCEEDED, (status, lines)


@pytest.mark.slurm
def test_an_exclusive_job_records_the_whole_node_it_held_and_usage_counts_it(store: LineageStore) -> None:
    """``--exclusive`` (or a cluster that gives whole cores) grants more than a job asked for: Slurm
    charges the allocation, and so must ``lineage usage``. The attempt records what was granted
    (scontrol's allocated TRES), beside what was asked, and CPU-hours count the granted CPUs."""
    from orchestrator.lineage.listing import RecordFilter
    from orchestrator.lineage.usage import usage

    require_slurm()
    import subprocess

    node_cpus = int(
        subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, check=True).stdout.split()[0]
    )
    launcher = get_launcher("slurm", extra_args=["--exclusive"])
    hold = JobSpec(name="exclusive", command=["sleep", "2"], cpus=1)
    attempt, status = run_job(store, launcher, hold, timeout=120)
    assert status.state is JobState.SUCCEEDED, status
    recorded = store.require(Attempt, attempt.id)
    assert recorded.resources is not None and recorded.resources["cpus"] == 1
    assert recorded.granted is not None and recorded.granted["cpus"] == node_cpus >= 1, recorded.granted
    assert recorded.granted["nodes"] == 1, recorded.granted  # (mem too, where the cluster allocates memory)
    hours = (recorded.ended_at - recorded.started_at).total_seconds() / 3600  # type: ignore[operator]
    report = usage(store, RecordFilter(), by="stage")
    assert report.total.cpu_hours == pytest.approx(hours * node_cpus), report.total

    shared = get_launcher("slurm")  # asked for and given one CPU: the same either way
    attempt, status = run_job(store, shared, JobSpec(name="shared", command=["true"], cpus=1), timeout=120)
    assert status.state is JobState.SUCCEEDED, status
    granted = store.require(Attempt, attempt.id).granted
    assert granted is not None and granted["cpus"] == 1, granted
    # where it ran, which it did not name: the cluster's default partition (nothing else records it)
    assert granted["partition"] == "debug", granted


def test_allocated_tres_is_read_in_slurms_own_forms() -> None:
    from orchestrator.launchers.slurm import granted_tres

    assert granted_tres("cpu=64,mem=500G,node=2,billing=64,gres/gpu=16,gres/gpu:a100=16") == {
        "cpus": 64,
        "memory_bytes": 500 * 2**30,
        "nodes": 2,
        "gpus": 16,
    }
    assert granted_tres("cpu=2,mem=3072M,node=1,energy=5") == {"cpus": 2, "memory_bytes": 3 * 2**30, "nodes": 1}
    assert granted_tres("(null)") is None and granted_tres("") is None and granted_tres(None) is None
    assert granted_tres("cpu=two,node=1") == {"nodes": 1}  # a value it cannot read leaves the rest
