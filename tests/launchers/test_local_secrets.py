"""A local job's secrets never reach its log file: where the job's environment holds secret values
(``-e MY_TOKEN=...``, an inherited ``WANDB_API_KEY``), its supervisor reads the job's output through a
pipe and writes it to the log with each value replaced by ``***`` (launchers/_supervise.py), so
neither the file nor ``openlab job logs``, in a process that does not know the values, shows one.
What the supervisor did before stays as it was on that path: exit codes, a command that could not
start, cancel, the time limit and its warning, tasks, log following; and a job without secrets still
writes its log file itself."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from orchestrator.launchers import JobSpec, JobState, JobStatus, get_launcher
from orchestrator.launchers._supervise import group_members, masked
from orchestrator.launchers.local import LocalLauncher

SECRET = "s3cr3t-value-42"
INHERITED = "wandb-inherited-0042"


def launcher() -> LocalLauncher:
    found = get_launcher("local", grace=2)
    assert isinstance(found, LocalLauncher)
    return found


def run(spec: JobSpec, timeout: float = 30) -> tuple[LocalLauncher, JobStatus, bytes]:
    """Run ``spec`` (with ``MY_TOKEN``) to its end: (launcher, status, the log file's bytes)."""
    local = launcher()
    handle = local.submit(spec)
    status = local.wait(handle, timeout=timeout)
    return local, status, Path(handle.log_path or "").read_bytes()


def with_secret(name: str, command: list[str], **kwargs: object) -> JobSpec:
    return JobSpec(name=name, command=command, env={"MY_TOKEN": SECRET}, **kwargs)  # type: ignore[arg-type]


def test_job_run_and_job_logs_never_show_a_secret_the_job_printed(run_cli, openlab_home: Path) -> None:
    """The report: ``job run -b local -e MY_TOKEN=... -- sh -c 'echo $MY_TOKEN'`` (and a secret the
    job inherits) wrote the value into ``logs/ID.log``, and ``job logs ID`` showed it."""
    job = 'echo "given $MY_TOKEN"; echo "inherited $WANDB_API_KEY"'
    ran = run_cli("job", "run", "-b", "local", "-e", f"MY_TOKEN={SECRET}", "--", "sh", "-c", job,
                  env={"WANDB_API_KEY": INHERITED})  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    (log,) = (openlab_home / "logs").glob("local-*.log")
    assert log.read_bytes() == b"given ***\ninherited ***\n"
    shown = run_cli("job", "logs", log.stem)  # another process, which knows neither value
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == "given ***\ninherited ***\n"
    assert SECRET not in ran.stdout + ran.stderr + shown.stderr and INHERITED not in ran.stdout + ran.stderr


def test_a_secret_in_a_jobs_name_or_folder_stays_out_of_its_state_file(tmp_path: Path) -> None:
    """``job run --name $TOKEN`` (or a working folder whose name holds one) wrote the value into
    ``jobs/local/ID.json``, which ``job list`` and ``job status`` read; lineage and the log masked it."""
    folder = tmp_path / f"work-{SECRET}"
    folder.mkdir()
    local, status, _ = run(with_secret(f"named-{SECRET}", ["true"], workdir=str(folder)))
    assert status.state is JobState.SUCCEEDED, status
    files = list(local.state_dir.glob("local-*.json"))
    assert files and all(SECRET not in path.read_text() for path in files)
    assert any("named-***" in path.read_text() for path in files), "the name is there, masked"


def test_the_log_keeps_every_byte_the_job_wrote_but_the_secrets() -> None:
    """A value cut in two by the pipe (written in two parts, 0.3 s apart) is masked whole; binary
    output and a last line without a newline are kept byte for byte."""
    script = (
        'printf "%s\\n" "$MY_TOKEN"; '
        'printf "cut: s3cr3t"; sleep 0.3; printf -- "-value-42 end\\n"; '
        "printf '\\000\\377\\376 s3 binary\\n'; "
        'printf "s3cr3t-value-4 is not it; no newline at the end"'
    )
    _, status, log = run(with_secret("bytes", ["sh", "-c", script]))
    assert status.state is JobState.SUCCEEDED, status
    assert log == b"***\ncut: *** end\n\x00\xff\xfe s3 binary\ns3cr3t-value-4 is not it; no newline at the end"


def test_a_line_reaches_the_log_and_its_follower_while_the_job_runs() -> None:
    """Chunk by chunk, not at the job's end: a follower sees the first line seconds before the last."""
    local = launcher()
    handle = local.submit(with_secret("live", ["sh", "-c", 'echo "first $MY_TOKEN"; sleep 4; echo second']))
    arrived: dict[str, float] = {}
    for line in local.logs(handle, follow=True):
        arrived.setdefault(line, time.monotonic())
    assert set(arrived) == {"first ***", "second"}, arrived
    assert arrived["second"] - arrived["first ***"] > 2.5, arrived


def test_exit_codes_and_a_command_that_could_not_start_are_as_they_were() -> None:
    _, status, log = run(with_secret("exits", ["sh", "-c", 'echo "$MY_TOKEN" >&2; exit 7']))
    assert status.state is JobState.FAILED and status.exit_code == 7 and status.reason == "exit code 7", status
    assert log == b"***\n"
    _, status, log = run(with_secret("missing", ["no-such-trainer", SECRET]))
    assert status.exit_code == 127 and "cannot run 'no-such-trainer'" in (status.reason or ""), status
    assert log == b"openlab: cannot run 'no-such-trainer': No such file or directory\n"
    _, status, log = run(with_secret("killed", ["sh", "-c", 'echo "$MY_TOKEN"; kill -KILL $$']))
    assert status.exit_code == 137 and status.reason == "killed by signal 9", status
    assert log == b"***\n"


def test_cancel_ends_a_job_whose_background_child_holds_the_pipe() -> None:
    local = launcher()
    handle = local.submit(with_secret("cancel", ["sh", "-c", 'sleep 300 & echo "started $MY_TOKEN"; sleep 300']))
    deadline = time.monotonic() + 20
    while b"started" not in Path(handle.log_path or "").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    local.cancel(handle)
    status = local.status(handle)
    assert status.state is JobState.CANCELLED, status
    assert time.monotonic() - start < 5, "the cancel waited for the SIGKILL: the job was told too late"
    assert group_members(local.process_group(handle)) == []
    assert Path(handle.log_path or "").read_bytes() == b"started ***\n"


def test_a_process_that_left_the_job_and_keeps_the_pipe_open_does_not_hold_up_its_end(tmp_path: Path) -> None:
    """The job's group is killed when its main process exits, which closes the pipe; a process in
    another session (setsid) survives that and keeps it open: the supervisor reads what is there and
    ends with the job all the same, instead of waiting for that process."""
    pid_file = tmp_path / "escaped.pid"
    script = f'setsid sh -c "echo \\$\\$ > {pid_file}; exec sleep 60" & echo "done $MY_TOKEN"'
    local = launcher()
    start = time.monotonic()
    handle = local.submit(with_secret("escape", ["sh", "-c", script]))
    try:
        status = local.wait(handle, timeout=30)
        assert status.state is JobState.SUCCEEDED, status
        assert time.monotonic() - start < 10, "the end waited for a process outside the job"
        assert Path(handle.log_path or "").read_bytes() == b"done ***\n"
    finally:
        deadline = time.monotonic() + 5
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


#: Says so when warned (SIGUSR1) and keeps running into its time limit.
WARNED = "trap 'echo \"warned $MY_TOKEN\"' USR1; echo ready; while :; do sleep 0.1; done"


def test_the_time_limit_and_its_warning_are_as_they_were() -> None:
    _, status, log = run(with_secret("limit", ["sh", "-c", WARNED], time_limit=3, warn_before_limit=2))
    assert status.state is JobState.FAILED and "time limit exceeded (3s)" in (status.reason or ""), status
    assert log.startswith(b"ready\n") and b"warned ***\n" in log and SECRET.encode() not in log, log


def test_the_tasks_of_a_job_print_through_the_mask_under_their_labels() -> None:
    from tests.conftest import REPO_ROOT

    code = "import os; print(os.environ['RANK'], os.environ['MY_TOKEN'], flush=True)"
    spec = with_secret("tasks", [sys.executable, "-c", code], tasks_per_node=2, workdir=str(REPO_ROOT))
    _, status, log = run(spec, timeout=60)
    assert status.state is JobState.SUCCEEDED, status
    assert sorted(log.decode().splitlines()) == ["0: 0 ***", "1: 1 ***"], log


def test_a_job_without_secrets_writes_its_log_file_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipe only where there is something to mask: otherwise the job's output is the file."""
    from orchestrator.secrets import is_secret_name

    for name in [name for name in os.environ if is_secret_name(name)]:
        monkeypatch.delenv(name)
    where = ["sh", "-c", "readlink /proc/self/fd/1"]
    local, status, log = run(JobSpec(name="plain", command=where))
    assert status.state is JobState.SUCCEEDED, status
    assert log.decode().strip().endswith(".log"), log
    _, status, log = run(with_secret("masked", where))
    assert log.decode().startswith("pipe:"), log


@pytest.mark.parametrize("cut", range(1, len(SECRET)))
def test_a_secret_cut_anywhere_between_two_reads_is_masked_and_nothing_else_waits(cut: int) -> None:
    secrets = [SECRET.encode(), b"other-secret"]
    first, held = masked(b"line one\nvalue " + SECRET.encode()[:cut], secrets)
    assert first == b"line one\nvalue " and held == SECRET.encode()[:cut]
    rest, held = masked(held + SECRET.encode()[cut:] + b" end\n", secrets)
    assert rest == b"*** end\n" and held == b""
    # an end that no secret begins with is written at once, and the last read keeps what waited
    assert masked(b"progress 50% s3x", secrets) == (b"progress 50% s3x", b"")
    assert masked(b"tail s3cr", secrets, final=True) == (b"tail s3cr", b"")


def test_the_job_state_file_keeps_the_command_masked() -> None:
    """The launcher's own ``ID.json`` kept the job's argv as given: ``--api-key`` values and URL passwords
    that lineage masks sat in a file under OPENLAB_HOME."""
    spec = JobSpec(
        name="masked-argv",
        command=["sh", "-c", "true", "--api-key", "sk_ARGSECRET_999", "postgresql://bob:pw_URLSECRET_77@db/x"],
    )
    local = launcher()
    handle = local.submit(spec)
    local.wait(handle, timeout=20)
    text = (local.state_dir / f"{handle.job_id}.json").read_text()
    assert "sk_ARGSECRET_999" not in text and "pw_URLSECRET_77" not in text, text
