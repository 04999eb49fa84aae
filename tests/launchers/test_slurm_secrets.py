"""A Slurm job's secrets never reach its log file: where the job's environment holds secret values
(``-e MY_TOKEN=...``, an inherited ``WANDB_API_KEY``), the batch script runs the job under the output
filter (the local supervisor's ``--mask-output`` mode, copied beside the logs), which writes what the
job prints with each value replaced by ``***``. slurmstepd writes the file, so the filter is the
parent of the usage wrapper (or of the command): it must leave the job's exit status, its signals (a
cancel's SIGTERM once, a warning for the batch shell once), its usage record and srun's labels as
they were. Against the real single-node cluster; the signals also without one, as slurmstepd sends
them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.launchers import JobHandle, JobSpec, JobState, get_launcher
from orchestrator.launchers.attempts import run_job
from orchestrator.launchers.base import helper_script
from orchestrator.launchers.slurm import SlurmLauncher, mask_filter_path
from orchestrator.lineage import LineageStore
from tests.launchers.test_slurm_usage import STOPS, warned
from tests.services import require_slurm

SECRET = "s3cr3t-value-42"
INHERITED = "wandb-inherited-0042"


def slurm(**options: object) -> SlurmLauncher:
    require_slurm()
    found = get_launcher("slurm", sacct=False, **options)
    assert isinstance(found, SlurmLauncher)
    return found


def with_secret(name: str, command: list[str], **kwargs: object) -> JobSpec:
    return JobSpec(name=name, command=command, env={"MY_TOKEN": SECRET}, **kwargs)  # type: ignore[arg-type]


def wait_for(launcher: SlurmLauncher, handle: JobHandle, word: str) -> None:
    deadline = time.monotonic() + 60
    while not any(word in line for line in launcher.logs(handle)) and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.slurm
def test_job_run_and_job_logs_never_show_a_secret_a_slurm_job_printed(run_cli, openlab_home: Path) -> None:
    """The report, on Slurm: the value was in ``slurm-ID.log``, and ``job logs ID`` (run where the
    value is unknown) showed it. A value cut in two by the pipe, binary output and a last line
    without a newline are kept as the job wrote them, but for the secrets; the exit code is the job's."""
    require_slurm()
    job = (
        'echo "given $MY_TOKEN"; echo "inherited $WANDB_API_KEY"; '
        'printf "cut: s3cr3t"; sleep 0.3; printf -- "-value-42 end\\n"; '
        "printf '\\000\\377 binary\\n'; printf 'no newline'; exit 3"
    )
    ran = run_cli("job", "run", "-b", "slurm", "-e", f"MY_TOKEN={SECRET}", "--", "bash", "-c", job,
                  env={"WANDB_API_KEY": INHERITED})  # fmt: skip
    assert ran.returncode == 3, ran.stdout + ran.stderr
    (log,) = (openlab_home / "logs").glob("slurm-*.log")
    assert log.read_bytes() == b"given ***\ninherited ***\ncut: *** end\n\x00\xff binary\nno newline"
    shown = run_cli("job", "logs", log.stem.removeprefix("slurm-"), "-b", "slurm")
    assert shown.returncode == 0, shown.stderr
    assert SECRET not in shown.stdout and INHERITED not in shown.stdout
    assert shown.stdout.startswith("given ***\ninherited ***\ncut: *** end\n"), shown.stdout
    assert (openlab_home / "logs" / f"{log.stem}.usage").exists()  # the usage wrapper still measured it


@pytest.mark.slurm
def test_the_tasks_of_a_slurm_job_print_through_the_mask_under_their_labels(store: LineageStore) -> None:
    """srun's ``--label`` still names each task's lines, and the task that failed first still gives
    the job its exit code and is named."""
    code = "import os; print('rank', os.environ['RANK'], os.environ['MY_TOKEN'], flush=True)"
    launcher = slurm()
    handle = launcher.submit(with_secret("tasks", [sys.executable, "-c", code], tasks_per_node=2))
    status = launcher.wait(handle, timeout=120)
    assert status.state is JobState.SUCCEEDED, status
    log = Path(handle.log_path or "").read_text()
    assert sorted(log.splitlines()) == ["0: rank 0 ***", "1: rank 1 ***"], log
    crash = f"import os, sys, time\nprint('{SECRET}')\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)"
    attempt, status = run_job(store, launcher, with_secret("crash", [sys.executable, "-c", crash], tasks_per_node=2))
    assert status.state is JobState.FAILED and status.exit_code == 3, status
    assert "task 1 of 2 on " in (attempt.reason or "") and "failed first (exit 3)" in (attempt.reason or "")


@pytest.mark.slurm
def test_a_cancelled_slurm_job_under_the_filter_is_told_once_and_its_use_kept() -> None:
    """Slurm sends SIGCONT and SIGTERM to every process of the job, the filter included: it outlives
    them without passing the SIGTERM on (the command got its own), and writes what the job said."""
    launcher = slurm()
    said = "import os\nprint('hello', os.environ['MY_TOKEN'], flush=True)\n"
    handle = launcher.submit(with_secret("stops", [sys.executable, "-c", said + STOPS]))
    try:
        wait_for(launcher, handle, "ready")
        launcher.cancel(handle)
    finally:
        launcher.cleanup(handle)
    deadline = time.monotonic() + 10
    while launcher.status(handle).usage is None and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = list(launcher.logs(handle))
    assert [line for line in lines if "got SIGTERM" in line] == ["got SIGTERM 1"], lines
    status = launcher.status(handle)
    assert status.state is JobState.CANCELLED and status.usage is not None, status
    assert "hello ***" in lines and SECRET not in Path(handle.log_path or "").read_text(), lines


@pytest.mark.slurm
@pytest.mark.parametrize("sig", ["USR1", "TERM"])
@pytest.mark.parametrize("measure_usage", [True, False], ids=["under the wrapper", "not measured"])
def test_a_warning_for_the_batch_shell_reaches_a_job_under_the_filter_once(measure_usage: bool, sig: str) -> None:
    """``scancel --batch`` (as ``--signal=B:USR1@300`` does it) signals the batch script's own process,
    which is now the filter: it passes the warning on, to the usage wrapper or to the command, once."""
    launcher = slurm(measure_usage=measure_usage)
    script = warned(f"SIG{sig}").replace('print("saved and done"', 'print("saved and done", os.environ["MY_TOKEN"]')
    handle = launcher.submit(with_secret("warned", [sys.executable, "-c", "import os\n" + script]))
    try:
        wait_for(launcher, handle, "ready")
        subprocess.run(["scancel", "--batch", f"--signal={sig}", handle.job_id], check=True, env=launcher._env())
        status = launcher.wait(handle, timeout=60)
    finally:
        launcher.cleanup(handle)
    lines = list(launcher.logs(handle))
    assert [line for line in lines if line.startswith("warned")] == ["warned 1"], lines
    assert "saved and done ***" in lines, lines
    assert status.state is JobState.SUCCEEDED and status.exit_code == 0, status
    assert (status.usage is not None) is measure_usage, status


@pytest.mark.slurm
def test_a_node_without_the_filters_python_runs_the_job_as_it_is() -> None:
    """Where the node has no such Python the job runs unfiltered (as it runs unmeasured): it must run."""
    launcher = slurm(python="no-such-python3b")
    handle = launcher.submit(with_secret("plain", ["sh", "-c", "echo ran", "--db-password", "pw"]))
    status = launcher.wait(handle, timeout=120)
    assert status.state is JobState.SUCCEEDED, status
    assert list(launcher.logs(handle)) == ["ran"]
    # the batch script holds the command as the job needs it, secrets and all: its owner's to read alone
    assert Path(handle.extra["script"]).stat().st_mode & 0o777 == 0o600


def test_the_batch_script_runs_a_job_with_secrets_under_the_filter_and_others_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from orchestrator.secrets import is_secret_name

    for name in [name for name in os.environ if is_secret_name(name)]:
        monkeypatch.delenv(name)
    launcher = get_launcher("slurm")
    plain = launcher.batch_script(JobSpec(name="x", command=["train"]), "/l/slurm-%j.log")
    assert "OPENLAB_MASK" not in plain and '"$@"' not in plain
    assert plain.splitlines()[-1].endswith("-- train; else exec train; fi")
    script = launcher.batch_script(with_secret("x", ["train"]), "/l/slurm-%j.log")
    assert f"OPENLAB_MASK_FILTER={mask_filter_path(Path('/l'))}" in script.splitlines()
    assert SECRET not in script  # the value reaches the job through sbatch's environment, never the script
    assert script.splitlines()[-1] == (
        'if [ -n "$OPENLAB_USAGE_PY" ]; then exec "$@" "$OPENLAB_USAGE_PY" -I -S "$OPENLAB_USAGE_WRAPPER" '
        '--slurm-batch "$OPENLAB_USAGE" -- train; else exec "$@" train; fi'
    )
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_inherited_123")  # inherited through --export=ALL
    assert "--mask-output --slurm-batch" in launcher.batch_script(JobSpec(name="x", command=["train"]), "/l/x.log")
    tasks = launcher.batch_script(with_secret("x", ["train"], tasks_per_node=2), "/l/x.log")
    assert "--mask-output --no-forward" in tasks and "--slurm-batch" not in tasks


@pytest.mark.parametrize("under", ["the usage wrapper", "nothing"])
@pytest.mark.parametrize(
    "how", ["a warning for the batch shell", "Slurm ends the job", "Slurm ends the job, TERM handled first"]
)
def test_the_filter_passes_on_a_warning_and_not_slurms_end_of_the_job(how: str, under: str, tmp_path: Path) -> None:
    """The filter as the batch shell's process, signalled as slurmstepd does it, without a cluster:
    a warning comes to it alone and reaches the command once (through the usage wrapper, or straight);
    Slurm's end of a job (SIGCONT then SIGTERM to every process) is not passed on. Its exit is the
    command's, its output masked."""
    filter_ = [sys.executable, "-I", "-S", str(helper_script("supervise.py")), "--mask-output", "--slurm-batch", "--"]
    wrapper = [sys.executable, "-I", "-S", str(helper_script("usage.py")), "--slurm-batch", str(tmp_path / "u"), "--"]
    command = [sys.executable, "-c", f"print('{SECRET}', flush=True)\n" + STOPS]
    env = {**os.environ, "MY_TOKEN": SECRET}
    argv = [*filter_, *(wrapper if under == "the usage wrapper" else []), *command]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "***"
    assert proc.stdout.readline().strip() == "ready"
    tree = [proc.pid]
    while len(tree) < (3 if under == "the usage wrapper" else 2):
        children = subprocess.run(["pgrep", "-P", str(tree[-1])], capture_output=True, text=True).stdout.split()
        tree.append(int(children[0]))
    if how == "a warning for the batch shell":
        os.kill(proc.pid, signal.SIGTERM)
    else:  # every process of the job, as slurmstepd does it
        order = [signal.SIGCONT, signal.SIGTERM]
        for pid in tree:
            for sig in order if how == "Slurm ends the job" else order[::-1]:
                os.kill(pid, sig)
    out, _ = proc.communicate(timeout=30)
    assert [line for line in out.splitlines() if "SIGTERM" in line] == ["got SIGTERM 1"], out
    assert proc.returncode == 143, (proc.returncode, out)


def test_the_filter_runs_on_the_oldest_python_the_helpers_support(tmp_path: Path) -> None:
    """The filter runs on the node's Python, like the usage wrapper: 3.8 or later."""
    import glob
    import shutil

    found = [shutil.which("python3.8"), *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.8*/bin/python3.8")))]
    runs = [p for p in found if p and subprocess.run([p, "-c", "pass"], capture_output=True).returncode == 0]
    if not runs:
        pytest.skip("no python3.8 here")
    python = runs[0]
    filter_ = [python, "-I", "-S", str(helper_script("supervise.py")), "--mask-output", "--no-forward", "--"]
    ran = subprocess.run(
        [*filter_, "sh", "-c", 'echo "$MY_TOKEN"; exit 5'], env={**os.environ, "MY_TOKEN": SECRET}, capture_output=True
    )
    assert (ran.returncode, ran.stdout, ran.stderr) == (5, b"***\n", b"")
