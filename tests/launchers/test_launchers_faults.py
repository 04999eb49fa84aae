"""Bad input and faults: clear errors quoting the backend, bounded retries, interrupted runs recorded."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from pytest_httpserver import HTTPServer

from orchestrator.errors import ConfigError, OpenlabError
from orchestrator.launchers import (
    BACKENDS,
    BackendUnavailable,
    ImageNotFound,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    JobTimeout,
    LauncherError,
    OtherCluster,
    get_launcher,
    parse_duration,
    parse_memory,
)
from orchestrator.launchers._supervise import group_members
from orchestrator.launchers.attempts import handle_from_attempt, run_job
from orchestrator.launchers.base import flag_option, list_option, number_option, table_option, usage_python
from orchestrator.lineage.models import Attempt, PipelineRun, StageRun
from orchestrator.lineage.store import LineageStore
from tests.forked_cli import run_cli
from tests.launchers.harness import Harness, jobcomp_only_slurm

#: ``openlab`` as a subprocess where a test needs the process itself (Popen, signals).
CLI = [sys.executable, "-m", "orchestrator.cli.main"]


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``openlab ARGS`` in a child process (:mod:`tests.forked_cli`), from ``cwd`` (else here)."""
    return run_cli(args, env={**os.environ, **(env or {})}, cwd=cwd or Path.cwd(), timeout=timeout)


# -- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("n[01-03,07],gpu1", ["n01", "n02", "n03", "n07", "gpu1"]),  # padding kept, ranges and singles
        ("a[9-11]", ["a9", "a10", "a11"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("localhost", ["localhost"]),
        ("", []),
    ],
)
def test_a_slurm_nodelist_names_every_node(nodelist: str, hosts: list[str]) -> None:
    from orchestrator.launchers.slurm import expand_hostlist

    assert expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        (45, 45),
        ("05:00", 300),
        ("1:02:03", 3723),
        ("1-00:00:01", 86401),
        # Slurm's forms with a day count read hours first, as sbatch --time does
        ("4-12", 4 * 86400 + 12 * 3600),
        ("1-02:30", 86400 + 2 * 3600 + 30 * 60),
        ("2-00:00:00", 2 * 86400),
        ("1h", 3600),
        ("30m", 1800),
        ("1h30m", 5400),
        ("45s", 45),
    ],
)
def test_time_limits_parse(text: str | int, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["abc", "0", "1:2:3:4", "-5", "", "1d", "-1:00", "1-2-3", "1-", "x-02:00"])
def test_bad_time_limits_are_user_errors(text: str) -> None:
    with pytest.raises(OpenlabError, match="time limit"):
        parse_duration(text)


def test_memory_parses_and_rejects() -> None:
    assert parse_memory("512M") == 512 * 2**20
    assert parse_memory("2G") == 2 * 2**30
    assert parse_memory("1.5Gi") == int(1.5 * 2**30)
    with pytest.raises(OpenlabError, match="invalid memory"):
        JobSpec(name="x", command=["true"], memory="lots")
    assert parse_memory("0") == 0 and parse_memory("277080") == 277080  # as sacct prints sizes: read leniently


@pytest.mark.parametrize(
    ("memory", "message"),
    [
        ("4096", "memory '4096' has no unit: sbatch reads a bare number as megabytes"),  # was --mem=1M, 4 KiB
        ("1.5", "write it with one, e.g. 1.5M or 4G"),
        ("0", "memory '0' is under 6M"),  # no limit here, all the node's memory to sbatch --mem=0
        ("0G", "or leave memory out for no limit"),
        ("5M", "the least a container can start in"),  # Docker refused it at the engine, after recording
    ],
)
def test_a_memory_request_without_a_unit_or_too_small_to_start_in_is_refused_before_it_is_sent(
    memory: str, message: str
) -> None:
    with pytest.raises(OpenlabError, match=re.escape(message)):
        JobSpec(name="x", command=["true"], memory=memory)
    assert JobSpec(name="x", command=["true"], memory="6M").memory_bytes == 6 * 2**20


def test_handle_round_trips_through_a_dict() -> None:
    handle = JobHandle("slurm", "123", "/tmp/x.log", {"array": True})
    assert JobHandle.from_dict(json.loads(json.dumps(handle.to_dict()))) == handle


@pytest.mark.parametrize(
    ("value", "expected"), [(True, True), (False, False), ("false", False), ("Off", False), ("0", False), ("yes", True)]
)
def test_yes_no_options_read_text_as_well_as_booleans(value: object, expected: bool) -> None:
    assert flag_option({"mount_workdir": value}, "mount_workdir", not expected) is expected


def test_yes_no_and_number_options_refuse_anything_else() -> None:
    """``"flase"`` is a non-empty string, true to Python: the opposite of what was meant."""
    assert flag_option({}, "init", True) is True and number_option({}, "grace", 5) == 5
    assert number_option({"grace": "2.5"}, "grace", 5) == 2.5
    with pytest.raises(ConfigError, match=r"backend option mount_workdir = 'flase' is not yes or no"):
        flag_option({"mount_workdir": "flase"}, "mount_workdir", True)
    for bad in ("soon", -1, True, "nan"):
        with pytest.raises(ConfigError, match=r"backend option grace = .* is not a number of zero or more"):
            number_option({"grace": bad}, "grace", 5)
    with pytest.raises(ConfigError, match="measure_usage = 'sometimes' is not yes or no"):
        usage_python({"measure_usage": "sometimes"}, {"openlab.io/python": "python"})
    assert usage_python({"measure_usage": "off"}, {"openlab.io/python": "python"}) is None
    assert usage_python({"measure_usage": "auto"}, {"openlab.io/python": "/opt/py"}) == "/opt/py"


def test_kubernetes_whole_number_options_and_a_long_names_label_are_what_the_api_server_takes() -> None:
    """`-o backoff_limit=three` was a ValueError traceback from the manifest, after the attempt was
    recorded; and a 64-character name cut to 63 could end its label in "-", which the API server
    refuses (a label value ends in a letter or digit)."""
    launcher = get_launcher("kubernetes")
    for options, said in (
        ({"backoff_limit": "three"}, "backend option backoff_limit = 'three' is not a number of zero or more"),
        ({"backoff_limit": -1}, "backend option backoff_limit = -1 is not a number of zero or more"),
        ({"ttl_seconds": "1.5"}, "backend option ttl_seconds = '1.5' is not a whole number: give one, e.g. 3600"),
    ):
        with pytest.raises(ConfigError, match=re.escape(said)):
            launcher.refuse_unsupported(JobSpec(name="x", command=["true"], image="i", options=options))
    job = launcher.manifest(JobSpec(name="x", command=["true"], image="i", options={"backoff_limit": "2"}), "x-1")
    assert job["spec"]["backoffLimit"] == 2
    label = launcher.manifest(JobSpec(name="a" * 62 + "-b", command=["true"], image="i"), "x-2")["metadata"]["labels"]
    assert label["openlab.io/job-name"] == "a" * 62


def test_a_warning_before_the_time_limit_is_slurms_signal_to_the_batch_shell() -> None:
    """The batch shell gets SIGUSR1 ahead of the limit (`B:`) and passes it on to the task, which
    saves and stops; a warning that does not come before the limit is refused before any job."""
    slurm = get_launcher("slurm")
    script = slurm.batch_script(JobSpec(name="x", command=["t"], time_limit=1800, warn_before_limit=180), "/l/x.log")
    assert "#SBATCH --time=00:30:00\n#SBATCH --signal=B:USR1@180\n" in script
    assert "--signal" not in slurm.batch_script(JobSpec(name="x", command=["t"], time_limit=1800), "/l/x.log")
    for limit, warn in ((60, 60), (60, 0)):
        with pytest.raises(OpenlabError, match="the warning before the time limit must be under the limit"):
            JobSpec(name="x", command=["t"], time_limit=limit, warn_before_limit=warn)
    with pytest.raises(OpenlabError, match="a warning 10 s before the time limit needs a time limit: give one"):
        JobSpec(name="x", command=["t"], warn_before_limit=10)


def test_extra_args_may_not_give_the_flags_openlab_writes_or_reads_the_job_through() -> None:
    """``extra_args=["--export=NONE"]`` ran the job without its -e values, ``--output=...`` sent its
    log where openlab does not read it (it recorded an empty one), and ``-p urgent`` beat the
    partition lineage recorded."""
    launcher = get_launcher("slurm")
    for flag, said in (
        ("--export=NONE", "--export is not for extra_args: the job's environment is passed with --export=ALL"),
        ("--output=/tmp/other-%j.out", "--output is not for extra_args: openlab reads the job's log"),
        ("-o /tmp/x.out", "--output is not for extra_args"),
        ("-p urgent", "--partition is not for extra_args: use the partition option"),
        ("--time 10", "--time is not for extra_args: give the time limit"),
        # sbatch takes any prefix that names one long option alone: these ran in batch with 2 CPUs
        ("--part=batch", "--partition is not for extra_args: use the partition option"),
        ("--cpus-per-t=2", "--cpus-per-task is not for extra_args: give cpus"),
    ):
        spec = JobSpec(name="x", command=["true"], options={"extra_args": [flag]})
        with pytest.raises(ConfigError, match=re.escape(f"extra_args {flag!r}: {said}")):
            launcher.refuse_unsupported(spec)
    for fine in (
        ["--exclusive"],
        ["--signal=B:TERM@120"],
        ["--gres=gpu:h100:8"],
        ["--dependency=afterok:1"],
        ["--mem-per-gpu=8G"],
        ["--export-file=/etc/env"],
    ):
        launcher.refuse_unsupported(JobSpec(name="x", command=["true"], options={"extra_args": fine}))


def test_extra_args_may_not_ask_again_what_the_jobs_own_gpus_memory_or_warning_ask() -> None:
    """Beside `gpus: 1`, `--gres=gpu:a100:2` gave the job two A100s while lineage asked one GPU; beside
    `memory: 4G`, sbatch refused `--mem-per-cpu` ("mutually exclusive") after the attempt was
    recorded. Alone, each is the user's to give; a GPU type is the gpu_type option."""
    launcher = get_launcher("slurm")
    for asked, flag in (
        ({"gpus": 1}, "--gres=gpu:a100:2"),
        ({"gpus": 2}, "-G 2"),
        ({"gpus": 1}, "--gpus-per-node=4"),
        ({"memory": "4G"}, "--mem-per-cpu=2G"),
        ({"time_limit": 600, "warn_before_limit": 60}, "--signal=B:TERM@120"),
    ):
        spec = JobSpec(name="x", command=["true"], options={"extra_args": [flag]}, **asked)
        with pytest.raises(ConfigError, match=re.escape(f"extra_args {flag!r} asks again what the job's")):
            launcher.refuse_unsupported(spec)
    launcher.refuse_unsupported(JobSpec(name="x", command=["true"], gpus=1, options={"extra_args": ["--gres=nvme:1"]}))
    with pytest.raises(ConfigError, match="a Slurm batch directive cannot hold a line break"):
        launcher.refuse_unsupported(JobSpec(name="x", command=["true"], options={"extra_args": ["--exclusive\n#X"]}))
    with pytest.raises(ConfigError, match="extra_args ' ': an empty flag; remove it"):
        launcher.refuse_unsupported(JobSpec(name="x", command=["true"], gpus=1, options={"extra_args": [" "]}))
    typed = JobSpec(name="x", command=["true"], gpus=2, options={"gpu_type": "a100"})
    launcher.refuse_unsupported(typed)
    assert "#SBATCH --gres=gpu:a100:2\n" in launcher.batch_script(typed, "/tmp/x.log")
    with pytest.raises(ConfigError, match="gpu_type 'a100 x': one GPU type as gres.conf names it"):
        launcher.refuse_unsupported(JobSpec(name="x", command=["true"], gpus=2, options={"gpu_type": "a100 x"}))


def test_table_and_list_options_refuse_text_instead_of_misreading_it() -> None:
    """A string where a list belongs was walked one character at a time: ``extra_args =
    "--exclusive"`` became eleven ``#SBATCH`` lines of one character each."""
    slurm = get_launcher("slurm")
    spec = JobSpec(name="x", command=["true"], options={"extra_args": ["--exclusive"]})
    assert "#SBATCH --exclusive\n" in slurm.batch_script(spec, "/tmp/x.log")
    bad = JobSpec(name="x", command=["true"], options={"extra_args": "--exclusive"})
    with pytest.raises(ConfigError, match=r"extra_args = '--exclusive' is not a list: give one, e.g. extra_args = \["):
        slurm.batch_script(bad, "/tmp/x.log")
    with pytest.raises(ConfigError, match="node_selector = 'gpu=a100' is not a table"):
        table_option({"node_selector": "gpu=a100"}, "node_selector", '{gpu = "a100"}')
    assert table_option({}, "mounts", "") == {} and list_option({}, "tolerations", "") == []


def test_a_bad_option_value_is_one_line_before_anything_is_recorded(store: LineageStore) -> None:
    proc = cli("job", "run", "--backend", "local", "-o", "grace=soon", "--", "true")
    assert proc.returncode == 2, proc.stderr
    assert "backend option grace = 'soon' is not a number" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert store.list(Attempt) == [], "a job refused for its options leaves no attempt"
    with pytest.raises(ConfigError, match=r"^\[backends.docker\] backend option pull = 'maybe' is not yes or no"):
        get_launcher("docker", pull="maybe")  # a setting in openlab.toml: refused when the launcher is made
    proc = cli("job", "run", "--backend", "local", "-q", "-o", "grace=0.5", "--", "true")
    assert proc.returncode == 0, proc.stderr


def test_a_misspelt_option_is_refused_naming_the_one_meant(store: LineageStore, tmp_path: Path) -> None:
    """``partiton = "gpu"`` was ignored without a word and the job went to the default partition."""
    proc = cli("job", "run", "--backend", "local", "-o", "gracee=3", "--", "true")
    assert proc.returncode == 2, proc.stderr
    said = "error: the local backend has no option 'gracee': did you mean 'grace'? it has: "
    assert proc.stderr.strip().startswith(said) and "poll_interval" in proc.stderr, proc.stderr
    assert store.list(Attempt) == [], "a job refused for its options leaves no attempt"
    with pytest.raises(ConfigError, match=r"^\[backends.slurm\] the slurm backend has no option 'partiton': did you "):
        get_launcher("slurm", partiton="gpu")  # a setting in openlab.toml: refused when the launcher is made
    # set in the environment, it is in no file: the variable is named
    proc = cli("job", "run", "--backend", "slurm", "--", "true", env={"OPENLAB_BACKENDS__SLURM__PARTITON": "gpu"})
    said = "[backends.slurm] (set by the environment variable OPENLAB_BACKENDS__SLURM__PARTITON) the slurm backend"
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    with pytest.raises(ConfigError, match=r"no option 'zzz': it has: .*poll_interval"):
        get_launcher("kubernetes").refuse_unsupported(JobSpec(name="x", command=["true"], options={"zzz": 1}))


KNOWN = "known backends: local, docker, slurm, kubernetes"


def test_a_backends_key_that_names_no_backend_is_refused_naming_the_one_meant(
    store: LineageStore, tmp_path: Path
) -> None:
    """``[backends.kubernets]`` was never read (its jobs ran with none of its settings), and
    ``default = "slurmm"`` surfaced only as an unknown backend, not where it was written."""
    config = tmp_path / "openlab.toml"
    for text, want in (
        (
            '[backends.kubernets]\nnamespace = "training"\n',
            "[backends.kubernets] is not a backend: did you mean 'kubernetes'? " + KNOWN,
        ),
        (
            '[backends]\ndefault = "slurmm"\n',
            "[backends] default = 'slurmm' is not a backend: did you mean 'slurm'? " + KNOWN,
        ),
        (
            '[backends]\nslurm = "gpu"\n',
            "[backends] slurm = 'gpu': the slurm backend's settings are a table, [backends.slurm]",
        ),
    ):
        config.write_text(text)
        # every command, as any misspelt setting: `lineage list` and `gc` ran on as if it were not there
        for args in (
            ("backends", "check"),
            ("job", "run", "-q", "--", "true"),
            ("lineage", "list"),
            ("gc", "--dry-run"),
        ):
            proc = cli(*args, env={"OPENLAB_CONFIG": str(config)})
            assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
            assert proc.stderr.strip() == f"error: {config}: {want}", proc.stderr
    assert store.list(Attempt) == [], "nothing was run or recorded"
    config.write_text('[backends]\ndefault = "local"\n[backends.local]\ngrace = 2\n')
    typo = {"OPENLAB_CONFIG": str(config), "OPENLAB_BACKENDS__SLRUM__PARTITION": "gpu"}  # said where it was written
    proc = cli("job", "run", "-q", "--", "true", env=typo)
    want = "error: OPENLAB_BACKENDS__SLRUM__PARTITION: [backends.slrum] is not a backend: did you mean 'slurm'? "
    want += KNOWN
    assert proc.returncode == 2 and proc.stderr.strip() == want, proc.stderr
    assert cli("job", "run", "-q", "--", "true", env={"OPENLAB_CONFIG": str(config)}).returncode == 0


def test_a_misspelt_job_run_option_is_refused_not_run_as_the_command(store: LineageStore) -> None:
    """``job run`` passes options it does not know on to the command, so that ``job run python -c X``
    needs no ``--``; ``--tasks 2 -- train`` (for --tasks-per-node) ran a program named --tasks."""
    proc = cli("job", "run", "--backend", "local", "--tasks", "2", "--", "true")
    assert proc.returncode == 2, proc.stderr
    want = "error: job run has no option '--tasks': did you mean --tasks-per-node? (the command goes after --)"
    assert proc.stderr.strip() == want, proc.stderr
    assert store.list(Attempt) == [], "nothing was run or recorded"
    proc = cli("job", "run", "--backend", "local", "-q", "sh", "-c", "exit 4")  # unknown options after the program
    assert proc.returncode == 4, proc.stderr


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_option_a_backend_reads_is_one_it_knows(name: str) -> None:
    """The known names are a list beside the code that reads the options: an option read but not
    listed would be refused as a typo. Every name the backend's module reads from its options is
    listed (the names read through a loop over a tuple are listed by hand, and checked here too)."""
    import inspect
    import re
    import sys

    from orchestrator.launchers.base import launcher_class

    cls = launcher_class(name)
    source = inspect.getsource(sys.modules[cls.__module__])
    read = set(re.findall(r'(?:opts|self\.config|config)(?:\.get\(|\[)"([a-z_]+)"', source))
    read |= set(re.findall(r'_option\((?:opts|self\.config|config), "([a-z_]+)"', source))
    read |= {"partition", "account", "qos", "array", "nodelist", "constraint"} if name == "slurm" else set()
    assert read, "the scan found nothing: the pattern no longer matches how options are read"
    assert read <= cls.known_options, read - cls.known_options


# -- unknown backend, docker faults ---------------------------------------------------------------


def test_unknown_backend_lists_the_known_ones() -> None:
    known = r"unknown backend 'nomad'; known backends: local, docker, slurm, kubernetes"  # none is close
    with pytest.raises(OpenlabError, match=known):
        get_launcher("nomad")
    proc = cli("job", "run", "--backend", "nomad", "--", "true")
    assert proc.returncode == 2
    assert "unknown backend 'nomad'" in proc.stderr and "Traceback" not in proc.stderr


def test_docker_engine_down_is_one_clear_line(tmp_path: Path) -> None:
    dead = f"unix://{tmp_path}/no-docker.sock"
    with pytest.raises(BackendUnavailable, match="docker engine not reachable at unix://"):
        get_launcher("docker", base_url=dead).submit(JobSpec(name="x", command=["true"]))
    proc = cli("job", "run", "--backend", "docker", "--", "true", env={"DOCKER_HOST": dead})
    assert proc.returncode == 2, proc.stderr
    assert f"docker engine not reachable at {dead}" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    ok, why = get_launcher("docker", base_url=dead).check()
    assert not ok and "not reachable" in why


@pytest.mark.docker
def test_docker_missing_image(docker_harness: Harness, store: LineageStore) -> None:
    # not openlab's own image, so building openlab's is not the answer: pull it, or the name is wrong
    hint = "docker pull openlab/no-such:1 (or set pull = true under [backends.docker]), or check the name"
    with pytest.raises(ImageNotFound) as refused:
        run_job(store, docker_harness.launcher, JobSpec(name="x", command=["true"], image="openlab/no-such:1"))
    assert str(refused.value) == f"image openlab/no-such:1 not found: {hint}"
    (attempt,) = store.list(Attempt)
    assert attempt.state == "FAILED" and "submit failed" in (attempt.reason or "")
    proc = cli("job", "run", "--backend", "docker", "--image", "openlab/no-such:1", "--", "true")
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: image openlab/no-such:1 not found: {hint}"


@pytest.mark.docker
@pytest.mark.slow
def test_docker_out_of_memory(docker_harness: Harness, store: LineageStore) -> None:
    job = JobSpec(
        name="oom",
        command=["python3", "-c", "x = bytearray(400 * 1024 * 1024); print(len(x))"],
        image=docker_harness.image,
        memory="64M",
    )
    attempt, status = run_job(store, docker_harness.launcher, job, timeout=120)
    assert status.state is JobState.FAILED
    assert status.reason and status.reason.startswith("out of memory"), status.reason
    assert status.exit_code == 137
    assert store.get(Attempt, attempt.id).reason.startswith("out of memory")  # type: ignore[union-attr]


# -- slurm faults ----------------------------------------------------------------------------------


@pytest.mark.slurm
def test_sbatch_refusal_is_quoted(slurm_harness: Harness) -> None:
    with pytest.raises(LauncherError, match="sbatch refused the job: .*Invalid partition name specified") as info:
        slurm_harness.launcher.submit(JobSpec(name="x", command=["true"], options={"partition": "no-such-partition"}))
    assert "Invalid partition name specified" in str(info.value)
    proc = cli("job", "run", "--backend", "slurm", "-o", "partition=no-such-partition", "--", "true")
    assert proc.returncode == 2 and "Invalid partition name specified" in proc.stderr


@pytest.mark.slurm
def test_a_slurm_job_runs_under_a_home_with_blanks_quotes_and_a_hash(slurm_harness: Harness, tmp_path: Path) -> None:
    """sbatch splits an #SBATCH line at blanks and ends it at '#': `OPENLAB_HOME=/data/my runs` made
    it refuse every job (`Invalid directive found in batch script: runs/logs/slurm-%j.log`), and
    `lab's` stopped at an unmatched quote. The job runs, in a working folder named the same way, and
    its log is where the attempt says; a backslash, which turns off --output's %j, is one line."""
    home = tmp_path / 'lab\'s #1 "best" runs'
    workdir = tmp_path / "my project"
    workdir.mkdir()
    proc = cli(
        "job",
        "run",
        "--backend",
        "slurm",
        "--",
        "sh",
        "-c",
        'echo "ran in $PWD"',
        env={"OPENLAB_HOME": str(home)},
        cwd=workdir,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"ran in {workdir}" in proc.stdout, proc.stdout
    logs = list((home / "logs").glob("slurm-*.log"))
    assert len(logs) == 1 and f"ran in {workdir}" in logs[0].read_text()
    refused = cli("job", "run", "--backend", "slurm", "--", "true", env={"OPENLAB_HOME": str(tmp_path / "a\\b")})
    assert refused.returncode == 2 and "has a backslash" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def _fake_slurm(tmp_path: Path, sbatch_body: str) -> Path:
    """A bin dir whose sbatch is a script: the retry logic needs no cluster to be tested."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "sbatch"
    script.write_text("#!/bin/sh\n" + sbatch_body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_sbatch_transient_errors_are_retried_a_bounded_number_of_times(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    body = (
        f"echo x >> {calls}\n"
        f'if [ "$(wc -l < {calls})" -lt 3 ]; then\n'
        '  echo "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation" >&2; exit 1\n'
        "fi\n"
        "echo 4242\n"
    )
    bin_dir = _fake_slurm(tmp_path, body)
    (bin_dir / "squeue").write_text("#!/bin/sh\nexit 0\n")  # asked before each retry: no such job in the queue
    (bin_dir / "squeue").chmod(0o755)
    launcher = get_launcher("slurm", bin_dir=str(bin_dir), retries=3)
    handle = launcher.submit(JobSpec(name="x", command=["true"]))
    assert handle.job_id == "4242" and calls.read_text().count("x") == 3

    calls.unlink()
    always = (
        f'echo x >> {calls}\necho "sbatch: error: Unable to contact slurm controller (connect failure)" >&2\nexit 1\n'
    )
    (tmp_path / "bin" / "sbatch").write_text("#!/bin/sh\n" + always)
    with pytest.raises(BackendUnavailable, match="Unable to contact slurm controller"):
        get_launcher("slurm", bin_dir=str(tmp_path / "bin"), retries=2).submit(JobSpec(name="x", command=["true"]))
    assert calls.read_text().count("x") == 3  # 1 try + 2 retries, then a clear error


def test_batch_script_carries_every_resource(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.secrets import is_secret_name

    for name in [name for name in os.environ if is_secret_name(name)]:  # a job with secrets runs under a filter
        monkeypatch.delenv(name)
    launcher = get_launcher("slurm", partition="debug", account="proj")
    job = JobSpec(
        name="train",
        command=["python", "-c", "print('a b')"],
        cpus=2.5,
        memory="1G",
        gpus=2,
        time_limit=90,
        workdir="/tmp",
        options={"array": "0-3", "qos": "high"},
    )
    script = launcher.batch_script(job, "/logs/slurm-%A_%a.log")
    for line in (
        "#SBATCH --job-name=train",
        "#SBATCH --output=/logs/slurm-%A_%a.log",
        "#SBATCH --time=00:01:30",
        "#SBATCH --cpus-per-task=3",
        "#SBATCH --mem=1024M",
        "#SBATCH --gres=gpu:2",
        "#SBATCH --partition=debug",
        "#SBATCH --account=proj",
        "#SBATCH --qos=high",
        "#SBATCH --array=0-3",
        "#SBATCH --chdir=/tmp",
        # each array task's usage wrapper writes its own record next to its log
        'OPENLAB_USAGE=/logs/slurm-"$SLURM_ARRAY_JOB_ID"_"$SLURM_ARRAY_TASK_ID".usage',
    ):
        assert line in script.splitlines(), (line, script)
    # the job is the batch shell's own process (exec), so a --signal=B:... warning reaches it
    assert script.splitlines()[-1].endswith(
        "-- python -c 'print('\"'\"'a b'\"'\"')'; else exec python -c 'print('\"'\"'a b'\"'\"')'; fi"
    )

    plain = launcher.batch_script(dataclasses.replace(job, options={**job.options, "measure_usage": False}), "/l/x.log")
    assert plain.splitlines()[-1] == "exec python -c 'print('\"'\"'a b'\"'\"')'", plain
    assert "OPENLAB_USAGE" not in plain


# -- kubernetes faults --------------------------------------------------------------------------------


def _status(code: int, message: str, reason: str) -> str:
    return json.dumps(
        {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason, "code": code}
    )


def test_kubernetes_4xx_quotes_the_api_message(httpserver: HTTPServer) -> None:
    message = 'jobs.batch is forbidden: User "ci" cannot create resource "jobs" in API group "batch" in namespace "ml"'
    httpserver.expect_request("/apis/batch/v1/namespaces/ml/jobs", method="POST").respond_with_data(
        _status(403, message, "Forbidden"), status=403, content_type="application/json"
    )
    # (no usage wrapper, so no helpers ConfigMap to create first: that path is the next test's)
    launcher = get_launcher("kubernetes", host=httpserver.url_for("/").rstrip("/"), namespace="ml", measure_usage=False)
    expected = "kubernetes API refused to create Job ml/openlab-x-.*: jobs.batch is forbidden"
    with pytest.raises(LauncherError, match=expected):
        launcher.submit(JobSpec(name="x", command=["true"]))
    assert len(httpserver.log) == 1  # a 4xx is not retried


def test_kubernetes_helpers_configmap_refused_or_left_behind(httpserver: HTTPServer) -> None:
    """A job under the usage wrapper (or of several tasks) gets its helper scripts in a ConfigMap
    made before the Job. A namespace where that is forbidden gets one line saying how to do
    without; a Job refused after its ConfigMap was made does not leave the ConfigMap behind."""
    import re

    message = 'configmaps is forbidden: User "ci" cannot create resource "configmaps" in API group "" in namespace "ml"'
    httpserver.expect_request("/api/v1/namespaces/ml/configmaps", method="POST").respond_with_data(
        _status(403, message, "Forbidden"), status=403, content_type="application/json"
    )
    url = httpserver.url_for("/").rstrip("/")
    launcher = get_launcher("kubernetes", host=url, namespace="ml", measure_usage=True)
    with pytest.raises(LauncherError) as refused:
        launcher.submit(JobSpec(name="x", command=["true"]))
    assert re.fullmatch(
        r"kubernetes API refused to create ConfigMap ml/openlab-x-\w+-openlab: configmaps is forbidden: .* "
        r"\(the job's helper scripts go in a ConfigMap; without the right to create one, "
        r"set \[backends.kubernetes\] helpers_configmap = false to run the image's own openlab\)",
        str(refused.value),
    ), refused.value
    assert [r.path for r, _ in httpserver.log] == ["/api/v1/namespaces/ml/configmaps"], "no Job is sent"

    httpserver.clear()
    made = {"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"name": "c", "namespace": "ml"}}
    httpserver.expect_request("/api/v1/namespaces/ml/configmaps", method="POST").respond_with_json(made, status=201)
    jobs_forbidden = 'jobs.batch is forbidden: User "ci" cannot create resource "jobs"'
    httpserver.expect_request("/apis/batch/v1/namespaces/ml/jobs", method="POST").respond_with_data(
        _status(403, jobs_forbidden, "Forbidden"), status=403, content_type="application/json"
    )
    deleted = re.compile(r"/api/v1/namespaces/ml/configmaps/openlab-x-\w+-openlab")
    httpserver.expect_request(deleted, method="DELETE").respond_with_json({"kind": "Status", "status": "Success"})
    with pytest.raises(LauncherError, match="refused to create Job ml/openlab-x-.*: jobs.batch is forbidden"):
        launcher.submit(JobSpec(name="x", command=["true"]))
    calls = [(r.method, r.path) for r, _ in httpserver.log]
    assert [m for m, _ in calls] == ["POST", "POST", "DELETE"], calls
    created = json.loads(httpserver.log[0][0].get_data())["metadata"]["name"]
    assert calls[2][1].endswith("/" + created), calls


def test_kubernetes_5xx_is_retried_then_reported(httpserver: HTTPServer) -> None:
    for _ in range(2):
        httpserver.expect_ordered_request("/apis/batch/v1/namespaces/default/jobs", method="POST").respond_with_data(
            _status(503, "etcdserver: leader changed", "ServiceUnavailable"),
            status=503,
            content_type="application/json",
        )
    httpserver.expect_ordered_request("/apis/batch/v1/namespaces/default/jobs", method="POST").respond_with_data(
        json.dumps({"kind": "Job", "apiVersion": "batch/v1", "metadata": {"name": "x"}}),
        status=201,
        content_type="application/json",
    )
    url = httpserver.url_for("/").rstrip("/")
    handle = get_launcher("kubernetes", host=url, retries=3, measure_usage=False).submit(
        JobSpec(name="x", command=["true"])
    )
    assert handle.job_id.startswith("default/openlab-x-")

    httpserver.clear()
    httpserver.expect_request("/apis/batch/v1/namespaces/default/jobs", method="POST").respond_with_data(
        _status(500, "internal error: etcd is down", "InternalError"), status=500, content_type="application/json"
    )
    with pytest.raises(BackendUnavailable, match="etcd is down"):  # an outage run_job waits out, not a refusal
        get_launcher("kubernetes", host=url, retries=2, measure_usage=False).submit(JobSpec(name="x", command=["true"]))
    assert len(httpserver.log) == 3


def test_kubernetes_429_is_retried_after_what_the_server_asks(httpserver: HTTPServer) -> None:
    """API Priority and Fairness answers a busy client 429 with Retry-After: a status look that got
    one was the job's end (FAILED, and a cancel of a healthy multi-day job)."""
    busy = _status(429, "too many requests, please try again later", "TooManyRequests")
    path = "/apis/batch/v1/namespaces/default/jobs"
    httpserver.expect_ordered_request(path, method="POST").respond_with_data(
        busy, status=429, content_type="application/json", headers={"Retry-After": "1"}
    )
    created = json.dumps({"kind": "Job", "apiVersion": "batch/v1", "metadata": {"name": "x"}})
    httpserver.expect_ordered_request(path, method="POST").respond_with_data(
        created, status=201, content_type="application/json"
    )
    url = httpserver.url_for("/").rstrip("/")
    started = time.monotonic()
    handle = get_launcher("kubernetes", host=url, retries=3, measure_usage=False).submit(
        JobSpec(name="x", command=["true"])
    )
    assert handle.job_id.startswith("default/openlab-x-") and time.monotonic() - started >= 1.0
    httpserver.clear()
    httpserver.expect_request(path, method="POST").respond_with_data(busy, status=429, content_type="application/json")
    with pytest.raises(BackendUnavailable, match="too many requests"):
        get_launcher("kubernetes", host=url, retries=1, measure_usage=False).submit(JobSpec(name="x", command=["true"]))


def test_kubernetes_unreachable_api(tmp_path: Path) -> None:
    launcher = get_launcher("kubernetes", host="http://127.0.0.1:9", retries=1)
    with pytest.raises(BackendUnavailable, match="kubernetes API at http://127.0.0.1:9 not reachable"):
        launcher.submit(JobSpec(name="x", command=["true"]))
    ok, why = launcher.check()
    assert not ok and "not reachable" in why


def test_the_manifest_carries_the_spec_and_passes_strict_validation(tmp_path: Path) -> None:
    launcher = get_launcher("kubernetes", host="http://127.0.0.1:9", measure_usage=False)  # no helpers' mount
    job = JobSpec(
        name="Train Big!",
        command=["python", "train.py"],
        cpus=1.5,
        memory="1G",
        gpus=1,
        time_limit=600,
        env={"A": "1"},
        labels={"openlab.io/stage-run": "srun_1", "openlab.io/note": "has spaces"},
        artifact_root=tmp_path,
        workdir="/work",
    )
    manifest = launcher.manifest(job, "openlab-train-big-12345678")
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert manifest["spec"]["template"]["spec"]["activeDeadlineSeconds"] == 600  # the pod's: from when it runs
    assert manifest["spec"]["backoffLimit"] == 0 and "activeDeadlineSeconds" not in manifest["spec"]
    assert manifest["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert "ttlSecondsAfterFinished" in manifest["spec"]
    assert container["resources"]["limits"] == {"cpu": "1500m", "memory": "1024Mi", "nvidia.com/gpu": "1"}
    assert {"name": "A", "value": "1"} in container["env"]
    assert container["volumeMounts"] == [{"name": "openlab-artifacts", "mountPath": str(tmp_path.resolve())}]
    assert manifest["metadata"]["labels"]["openlab.io/stage-run"] == "srun_1"
    assert "openlab.io/note" not in manifest["metadata"]["labels"]  # not a valid label value...
    assert manifest["metadata"]["annotations"]["openlab.io/note"] == "has spaces"  # ...so kept as an annotation


def test_an_artifact_volume_the_template_gives_is_kept_not_replaced_by_a_host_path(tmp_path: Path) -> None:
    """A cluster's shared storage (a PVC, NFS) named openlab-artifacts in the template was replaced
    by a hostPath: each node wrote to its own disk, and Pod Security "baseline" refused the pod."""

    def shared(manifest: dict[str, Any]) -> None:
        pod = manifest["spec"]["template"]["spec"]
        pod["volumes"] = [{"name": "openlab-artifacts", "persistentVolumeClaim": {"claimName": "lab-artifacts"}}]

    path = _edited_template(tmp_path, shared)
    launcher = get_launcher("kubernetes", host="http://127.0.0.1:9", template=str(path), measure_usage=False)
    job = JobSpec(name="x", command=["true"], artifact_root=tmp_path / "artifacts")
    pod = launcher.manifest(job, "openlab-x-12345678")["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "openlab-artifacts", "persistentVolumeClaim": {"claimName": "lab-artifacts"}}]
    root = str((tmp_path / "artifacts").resolve())
    assert {"name": "openlab-artifacts", "mountPath": root} in pod["containers"][0]["volumeMounts"]
    plain = get_launcher("kubernetes", host="http://127.0.0.1:9", measure_usage=False)
    volumes = plain.manifest(job, "openlab-x-12345678")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "openlab-artifacts", "hostPath": {"path": root, "type": "DirectoryOrCreate"}} in volumes


def test_a_cancel_waits_longer_than_the_grace_the_pods_are_given_to_save(tmp_path: Path) -> None:
    """30 s flat, the pods' own default grace: a job that saves on SIGTERM outlived the wait, and
    the cancel ended "pods still exist", recording the attempt FAILED instead of CANCELLED."""
    assert get_launcher("kubernetes", host="http://127.0.0.1:9").cancel_wait() == 60  # Kubernetes' 30 s, and 30

    def patient(manifest: dict[str, Any]) -> None:
        manifest["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 300

    path = _edited_template(tmp_path, patient)
    assert get_launcher("kubernetes", host="http://127.0.0.1:9", template=str(path)).cancel_wait() == 330
    assert get_launcher("kubernetes", host="http://127.0.0.1:9", cancel_timeout=10).cancel_wait() == 10


def test_a_stages_placement_reaches_the_pod_over_the_templates(tmp_path: Path) -> None:
    """Node selector, tolerations, priority class and service account (a recipe's per-stage
    `kubernetes:` options) join the template's own and still pass strict validation."""
    template = _edited_template(
        tmp_path,
        lambda m: m["spec"]["template"]["spec"].update(
            nodeSelector={"kubernetes.io/os": "linux"}, tolerations=[{"key": "spot", "operator": "Exists"}]
        ),
    )
    launcher = get_launcher("kubernetes", host="http://127.0.0.1:9", template=str(template))
    options = {
        "namespace": "training",
        "node_selector": {"pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "priority_class": "training-high",
        "service_account": "trainer",
    }
    manifest = launcher.manifest(JobSpec(name="pretrain", command=["true"], options=options), "openlab-pretrain-1")
    pod = manifest["spec"]["template"]["spec"]
    assert manifest["metadata"]["namespace"] == "training"
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "pool": "gpu"}
    assert pod["tolerations"] == [
        {"key": "spot", "operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]
    assert (pod["priorityClassName"], pod["serviceAccountName"]) == ("training-high", "trainer")
    bad = {"tolerations": [{"key": "gpu", "tolerationSeconds": "soon"}]}  # [backends.kubernetes] is not a recipe
    with pytest.raises(OpenlabError, match=r"'soon' is not of type 'integer'.*at spec/template/spec/tolerations/1"):
        launcher.manifest(JobSpec(name="pretrain", command=["true"], options=bad), "openlab-pretrain-2")


def _edited_template(tmp_path: Path, edit: Any) -> Path:
    """The shipped template after a user's edit, as a file ``template = ...`` can point at."""
    import yaml

    from orchestrator.launchers.kubernetes import DEFAULT_TEMPLATE

    manifest = yaml.safe_load(DEFAULT_TEMPLATE.read_text())
    edit(manifest)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda m: m["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicey="Always"),
            "Additional properties are not allowed ('imagePullPolicey' was unexpected) "
            "(at spec/template/spec/containers/0)",
        ),
        (
            lambda m: m["spec"]["template"]["spec"].update(tolerations=[{"key": "gpu", "operater": "Exists"}]),
            "Additional properties are not allowed ('operater' was unexpected) (at spec/template/spec/tolerations/0)",
        ),
        (
            lambda m: m["spec"].update(backoffLimit="none"),
            "'none' is not of type 'integer', 'null' (at spec/backoffLimit)",
        ),
    ],
    ids=["typo-in-container", "typo-in-a-list-item", "wrong-type"],
)
def test_an_edited_template_with_a_bad_field_is_refused_before_anything_is_sent(
    tmp_path: Path, httpserver: HTTPServer, edit: Any, expected: str
) -> None:
    """Strict: the API server would drop an unknown field silently, so the job would run without it."""
    path = _edited_template(tmp_path, edit)
    url = httpserver.url_for("/").rstrip("/")
    launcher = get_launcher("kubernetes", host=url, template=str(path))
    with pytest.raises(LauncherError) as info:
        launcher.submit(JobSpec(name="x", command=["true"]))
    assert str(info.value) == f"job manifest is invalid for Kubernetes 1.33 (from template {path}): {expected}"
    assert len(httpserver.log) == 0  # refused here: the API server never saw it

    proc = cli(
        "job",
        "run",
        "--backend",
        "kubernetes",
        "--",
        "true",
        env={
            "OPENLAB_BACKENDS__KUBERNETES__HOST": url,
            "OPENLAB_BACKENDS__KUBERNETES__TEMPLATE": str(path),
            "OPENLAB_BACKENDS__KUBERNETES__RETRIES": "0",
        },
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert expected in proc.stderr and str(path) in proc.stderr
    assert len(httpserver.log) == 0


def test_manifests_are_validated_for_the_configured_kubernetes_version(tmp_path: Path) -> None:
    """``successPolicy`` exists from Kubernetes 1.30: a template using it is refused for an older cluster."""

    def indexed(m: dict[str, Any]) -> None:
        m["spec"].update(
            completionMode="Indexed", completions=2, parallelism=2, successPolicy={"rules": [{"succeededIndexes": "0"}]}
        )

    path = _edited_template(tmp_path, indexed)
    job = JobSpec(name="x", command=["true"])
    manifest = get_launcher("kubernetes", host="http://127.0.0.1:9", template=str(path), version="1.31").manifest(
        job, "openlab-x-12345678"
    )
    assert manifest["spec"]["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}  # kept, as the template says
    old = get_launcher("kubernetes", host="http://127.0.0.1:9", template=str(path), version="1.29")
    with pytest.raises(LauncherError, match=r"invalid for Kubernetes 1\.29 .*'successPolicy' was unexpected"):
        old.manifest(job, "openlab-x-12345678")
    unknown = get_launcher("kubernetes", host="http://127.0.0.1:9", version="1.99")
    with pytest.raises(LauncherError, match=r"^kubernetes-validate has no schema for Kubernetes 1\.99$"):
        unknown.submit(job)


def test_every_manifest_sent_was_validated(tmp_path: Path, httpserver: HTTPServer, monkeypatch: Any) -> None:
    """Each create call the launcher makes (the helpers ConfigMap, then the Job) carries exactly the
    manifest that passed strict validation; then the Job is made the ConfigMap's owner."""
    import kubernetes_validate

    validated: list[dict[str, Any]] = []
    real = kubernetes_validate.validate

    def spy(manifest: dict[str, Any], version: str, strict: bool = False, *args: Any, **kwargs: Any) -> Any:
        assert strict is True and version == "1.32"
        validated.append(json.loads(json.dumps(manifest)))
        return real(manifest, version, strict, *args, **kwargs)

    monkeypatch.setattr(kubernetes_validate, "validate", spy)
    import re

    made = {"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"name": "c"}}
    configmaps = "/api/v1/namespaces/default/configmaps"
    httpserver.expect_request(configmaps, method="POST").respond_with_json(made, status=201)
    httpserver.expect_request("/apis/batch/v1/namespaces/default/jobs", method="POST").respond_with_data(
        json.dumps({"kind": "Job", "apiVersion": "batch/v1", "metadata": {"name": "x", "uid": "u-1"}}),
        status=201,
        content_type="application/json",
    )
    owned = re.compile(r"/api/v1/namespaces/default/configmaps/openlab-x-\w+-openlab")
    httpserver.expect_request(owned, method="PATCH").respond_with_json(made)
    launcher = get_launcher("kubernetes", host=httpserver.url_for("/").rstrip("/"), version="1.32")
    job = JobSpec(name="x", command=["echo", "hi"], env={"A": "1"}, artifact_root=tmp_path, cpus=1, tasks_per_node=2)
    handle = launcher.submit(job)
    (cm, _), (sent, _), (patch, _) = httpserver.log
    assert validated == [json.loads(sent.get_data()), json.loads(cm.get_data())]  # built Job first, sent second
    assert set(validated[1]["data"]) == {"tasks.py", "usage.py"}
    volumes = validated[0]["spec"]["template"]["spec"]["volumes"]
    helpers = {"name": validated[1]["metadata"]["name"], "defaultMode": 0o444}
    assert {"name": "openlab-helpers", "configMap": helpers} in volumes
    assert validated[1]["metadata"]["name"] == handle.job_id.split("/")[1] + "-openlab"
    owner = json.loads(patch.get_data())["metadata"]["ownerReferences"]
    assert [(o["kind"], o["uid"]) for o in owner] == [("Job", "u-1")]


# -- interrupted and timed-out runs are still recorded -----------------------------------------------


def test_interrupt_cancels_the_job_and_records_it(store: LineageStore) -> None:
    launcher = get_launcher("local", grace=1)
    lines: list[str] = []

    def interrupt() -> bool:
        if "started" in lines:
            raise KeyboardInterrupt
        return False

    with pytest.raises(KeyboardInterrupt):
        run_job(
            store,
            launcher,
            JobSpec(name="x", command=["sh", "-c", "echo started; sleep 60"]),
            on_log=lines.append,
            should_cancel=interrupt,
        )
    (attempt,) = store.list(Attempt)
    assert attempt.state == "CANCELLED" and attempt.reason == "interrupted" and attempt.ended_at
    assert group_members(launcher.process_group(handle_from_attempt(attempt))) == []


def test_sigterm_to_a_job_run_cancels_its_job_and_records_it(store: LineageStore) -> None:
    """``kill``, ``timeout``, systemd, a CI runner and the end of an enclosing Slurm job stop a command
    with SIGTERM. It killed ``openlab job run`` on the spot: the job ran on, its attempt RUNNING for
    good, and the reaper does not look at jobs outside a pipeline. Now it stops as Ctrl-C does."""
    marker = f"300.{uuid.uuid4().int % 10**6:06d}"  # a sleep no other job runs
    runner = subprocess.Popen(
        [*CLI, "job", "run", "-q", "--backend", "local", "--", "sleep", marker], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not (running := [a for a in store.list(Attempt) if a.state == "RUNNING"]):
        assert time.monotonic() < deadline, "the job never showed up as RUNNING in lineage"
        time.sleep(0.1)
    runner.terminate()
    _, err = runner.communicate(timeout=60)
    assert runner.returncode == 143 and err.strip().endswith("terminated"), (runner.returncode, err)
    attempt = store.require(Attempt, running[0].id)
    assert (attempt.state, attempt.reason) == ("CANCELLED", "terminated (SIGTERM)"), attempt
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True, check=False).stdout.split()
    assert left == [], f"the job runs on: pids {left}"


def test_a_crash_in_the_caller_fails_the_attempt(store: LineageStore) -> None:
    launcher = get_launcher("local", grace=1)

    def broken() -> bool:
        raise RuntimeError("flow crashed")

    with pytest.raises(RuntimeError):
        run_job(store, launcher, JobSpec(name="x", command=["sleep", "60"]), should_cancel=broken)
    (attempt,) = store.list(Attempt)
    assert attempt.state == "FAILED" and attempt.reason == "RuntimeError: flow crashed"
    assert group_members(launcher.process_group(handle_from_attempt(attempt))) == []


def test_timeout_cancels_and_raises(store: LineageStore) -> None:
    launcher = get_launcher("local", grace=1)
    started = time.monotonic()
    with pytest.raises(JobTimeout):
        run_job(store, launcher, JobSpec(name="x", command=["sleep", "60"]), timeout=0.5)
    assert time.monotonic() - started < 10
    (attempt,) = store.list(Attempt)
    assert attempt.state == "CANCELLED" and "did not finish within" in (attempt.reason or "")


def test_attempt_numbers_count_per_stage_run(store: LineageStore) -> None:
    with store.transaction() as tx:
        srun = tx.add(StageRun(stage="s", identity="i"))
    launcher = get_launcher("local")
    numbers = [
        run_job(store, launcher, JobSpec(name="x", command=["true"]), stage_run_id=srun.id)[0].number for _ in range(3)
    ]
    assert numbers == [1, 2, 3]


def test_secret_values_never_reach_lineage_or_streamed_logs(store: LineageStore) -> None:
    secret = "s3cr3t-value-123"
    lines: list[str] = []
    attempt, status = run_job(
        store,
        get_launcher("local"),
        JobSpec(name="x", command=["sh", "-c", 'echo "token is $API_TOKEN"'], env={"API_TOKEN": secret}),
        on_log=lines.append,
    )
    assert status.state is JobState.SUCCEEDED
    assert lines == ["token is ***"]
    dumped = json.dumps([e.payload for e in store.events()])
    assert secret not in dumped  # the command keeps "$API_TOKEN" unexpanded; the env is never recorded


# -- the CLI end to end (local backend: another process revives the handle from lineage) ------------


def test_job_commands_and_the_reaper_leave_a_job_of_another_cluster_alone(store: LineageStore) -> None:
    """An attempt recorded on another cluster (an openlab home shared by two sites, a lineage
    database copied for an audit) names a job id that is nobody's here, or someone else's: `job
    status`, `logs` and `cancel` refuse it in one line, `job list` says so, and the reaper leaves
    its stage run alone instead of calling it lost or cancelling this cluster's job of that id."""
    from orchestrator.launchers.attempts import submit_attempt
    from orchestrator.pipeline.reconcile import reconcile_all

    launcher = get_launcher("local")
    attempt, handle = submit_attempt(store, launcher, JobSpec(name="here", command=["sleep", "300"]))
    try:
        with store.transaction() as tx:
            srun = tx.add(StageRun(stage="pretrain", identity="i-west", state="RUNNING"))  # no lease: stale
            west = tx.add(
                Attempt(
                    stage_run_id=srun.id,
                    backend="local",
                    cluster="west",
                    job_id=attempt.job_id,
                    log_path=attempt.log_path,
                    state="RUNNING",
                )
            )
        said = (
            f"error: attempt {west.id} (job {attempt.job_id}) ran on local cluster 'west', and this openlab's "
            f"local backend talks to {os.uname().nodename!r}: ask from where [backends.local] reaches 'west'"
        )
        for command in ("status", "logs", "cancel"):
            proc = cli("job", command, west.id)
            assert proc.returncode == 2 and proc.stderr.strip() == said, (command, proc.stdout, proc.stderr)
        assert launcher.status(handle).state is JobState.RUNNING, "this cluster's job of that id runs on"
        listed = {row["attempt"]: row for row in json.loads(cli("job", "list", "--json").stdout)}
        assert listed[west.id]["cluster"] == "west" and listed[west.id]["note"] == f"not asked: {said[7:]}"
        assert listed[attempt.id]["cluster"] == os.uname().nodename and listed[attempt.id]["state"] == "RUNNING"
        report = reconcile_all(store)  # the reaper: says what it left, and why, in the reaper flow's log
        assert report.lines() == [f"left stage run {srun.id} (pretrain job {attempt.job_id}) running: {said[7:]}"]
        closed = "Closed: 0 run(s) left RUNNING by dead orchestrators"
        assert report.headline == f"{closed}; 1 on another cluster left running"

        assert store.get(StageRun, srun.id).state == "RUNNING"  # type: ignore[union-attr]
        assert store.get(Attempt, west.id).state == "RUNNING"  # type: ignore[union-attr]
        assert launcher.status(handle).state is JobState.RUNNING
    finally:
        launcher.cancel(handle)


def test_a_cluster_named_in_the_settings_is_what_attempts_record(store: LineageStore, tmp_path: Path) -> None:
    """A Kubernetes cluster's own name is its API server's address: `[backends.NAME] cluster`
    gives it the lab's name, recorded on each attempt; one job cannot claim another cluster."""
    config = tmp_path / "openlab.toml"
    config.write_text('[backends.local]\ncluster = "lab-a"\n')
    done = cli("job", "run", "-q", "--backend", "local", "--", "true", env={"OPENLAB_CONFIG": str(config)})
    assert done.returncode == 0, done.stderr
    (attempt,) = store.list(Attempt)
    assert attempt.cluster == "lab-a"
    refused = cli("job", "run", "--backend", "local", "-o", "cluster=lab-b", "--", "true")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "error: cluster is a [backends.local] setting, the name this openlab gives the place its local jobs "
        "run, not an option of one job: set it in openlab.toml"
    ), refused.stderr
    assert len(store.list(Attempt)) == 1, "nothing recorded for the refused job"
    # how openlab reaches a backend is its setting too: `-o slurm_conf=...` was accepted and ignored,
    # and the job went to the default cluster
    for backend, option in (("slurm", "slurm_conf=/etc/slurm-west/slurm.conf"), ("local", "poll_interval=5")):
        refused = cli("job", "run", "--backend", backend, "-o", option, "--", "true")
        key = option.partition("=")[0]
        assert refused.returncode == 2 and refused.stderr.strip() == (
            f"error: {key} is a [backends.{backend}] setting (how this openlab reaches and asks the backend), not "
            f"an option of one job: set it in openlab.toml or as OPENLAB_BACKENDS__{backend.upper()}__{key.upper()}"
        ), refused.stderr
    assert len(store.list(Attempt)) == 1, "nothing recorded for the refused jobs"
    named = get_launcher("local", cluster="lab-a")
    with pytest.raises(OtherCluster, match="ran on local cluster 'lab-b'"):
        with store.transaction() as tx:
            other = tx.add(Attempt(backend="local", job_id=attempt.job_id, cluster="lab-b"))
        handle_from_attempt(other, named)
    with store.transaction() as tx:  # recorded under the backend's own name, before the setting named it
        before = tx.add(Attempt(backend="local", job_id=attempt.job_id, cluster=os.uname().nodename))
    assert handle_from_attempt(before, named).job_id == attempt.job_id
    assert run_job(store, named, JobSpec(name="x", command=["true"]))[0].cluster == "lab-a"


def test_status_of_an_ended_job_is_its_record_when_the_backend_cannot_be_asked(store: LineageStore) -> None:
    """On a laptop without the cluster's config (or with its engine down), `job status` of a job that
    ended was the backend's error; lineage holds its end, so that is said, with why it is the record.
    A job not known to have ended still needs its backend: the error stands."""
    with store.transaction() as tx:
        ended = tx.add(Attempt(backend="docker", job_id="c0ffee", state="FAILED", exit_code=3, host="h1"))
        live = tx.add(Attempt(backend="docker", job_id="dead11", state="RUNNING"))
    unreachable = {"DOCKER_HOST": "tcp://127.0.0.1:9"}  # nothing listens there
    shown = cli("job", "status", ended.id, "--json", env=unreachable)
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert (data["state"], data["exit_code"], data["host"]) == ("FAILED", 3, "h1")
    assert data["source"].startswith("as recorded when it ended (docker: docker engine not reachable"), data
    refused = cli("job", "status", live.id, env=unreachable)
    assert refused.returncode == 2 and refused.stderr.startswith("error: docker engine not reachable"), refused.stderr
    assert store.get(Attempt, live.id).state == "RUNNING"  # nothing was decided without its backend


def test_cli_job_run_warns_ahead_of_the_time_limit_as_sbatch_signal_does(store: LineageStore) -> None:
    """`--warn-before-limit 55` with `--time-limit 1m`: SIGUSR1 at 5 s. A job that saves and stops on it
    was stopped from outside, not failed; a warning without a limit, or a bad one, is one line."""
    saves = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: (print('saving'), sys.exit(138)))\n"
        "time.sleep(60)"
    )
    run = cli(
        "job",
        "run",
        "--backend",
        "local",
        "--time-limit",
        "1m",
        "--warn-before-limit",
        "55",
        "--",
        sys.executable,
        "-c",
        saves,
    )
    assert run.returncode == 138 and run.stdout == "saving\n", (run.stdout, run.stderr)
    assert "PREEMPTED exit 138 (stopped by SIGUSR1 from outside" in run.stderr, run.stderr
    (attempt,) = store.list(Attempt)
    assert attempt.state == "PREEMPTED" and attempt.resources == {"time_limit": 60, "warn_before_limit": 55}
    for args, said in (
        (("--warn-before-limit", "5"), "error: a warning 5 s before the time limit needs a time limit: give one"),
        (("--time-limit", "60", "--warn-before-limit", "5x"), "error: --warn-before-limit: invalid time limit '5x'"),
        (("--time-limit", "1-"), "error: --time-limit: invalid time limit '1-'"),
    ):
        bad = cli("job", "run", "--backend", "local", *args, "--", "true")
        assert bad.returncode == 2 and bad.stderr.startswith(said) and len(bad.stderr.splitlines()) == 1, bad.stderr
    assert len(store.list(Attempt)) == 1, "nothing recorded for a refused job"


def test_cli_job_run_status_logs_cancel(store: LineageStore) -> None:
    proc = cli(
        "job",
        "run",
        "--backend",
        "local",
        "-e",
        "FOO=bar",
        "--time-limit",
        "1m",
        "--",
        "sh",
        "-c",
        "echo hi $FOO; exit 4",
    )
    assert proc.returncode == 4, proc.stderr
    assert proc.stdout == "hi bar\n"
    (attempt,) = store.list(Attempt)
    assert attempt.state == "FAILED" and attempt.exit_code == 4 and attempt.job_id in proc.stderr

    status = json.loads(cli("job", "status", attempt.job_id, "--json").stdout)  # type: ignore[arg-type]
    assert status["state"] == "FAILED" and status["exit_code"] == 4 and status["attempt"] == attempt.id
    assert status["usage"]["cpu_seconds"] >= 0 and status["usage"]["max_rss_bytes"] > 0, status
    shown = cli("job", "status", attempt.job_id, env={"COLUMNS": "60"}).stdout  # type: ignore[arg-type]
    assert "        used: peak memory " in shown
    assert f"    log_path: {attempt.log_path}\n" in shown, "a path is copied whole, not wrapped at the width"
    assert cli("job", "logs", attempt.id).stdout == "hi bar\n"
    with store.transaction() as tx:  # a stage run's jobs: `job logs srun_...` is its last one's
        prun = tx.add(PipelineRun(recipe="r", replica="tiny", backend="local"))
        srun = tx.add(StageRun(stage="pretrain", identity="i-logs", pipeline_run_id=prun.id))
        tx.update(attempt, stage_run_id=srun.id)
        idle = tx.add(StageRun(stage="eval", identity="i-idle"))
    assert cli("job", "logs", srun.id[:12]).stdout == "hi bar\n"
    never = cli("job", "logs", idle.id)
    assert never.returncode == 2 and "ran no job" in never.stderr, never.stderr
    whole = cli("job", "logs", prun.id)  # a pipeline run has a job per stage: which, is named
    assert whole.returncode == 2 and whole.stderr.strip() == (
        f"error: {prun.id} is a pipeline run, a job per stage: give one of its stage runs (pretrain {srun.id})"
    ), whole.stderr

    runner = subprocess.Popen(  # submitted by the login account ada (getpass reads LOGNAME first, as login sets it)
        [*CLI, "job", "run", "-q", "--backend", "local", "--", "sleep", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LOGNAME": "ada"},
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = [a for a in store.list(Attempt) if a.state == "RUNNING"]
        if running:
            break
        time.sleep(0.2)
    assert running, "the second job never showed up as RUNNING in lineage"
    (out_now,) = json.loads(cli("job", "list", "--json").stdout)  # type: ignore[arg-type]
    assert (out_now["attempt"], out_now["state"], out_now["job_id"], out_now["user"]) == (
        running[0].id,
        "RUNNING",
        running[0].job_id,
        "ada",
    )
    table = cli("job", "list", env={"COLUMNS": "80"}).stdout  # type: ignore[arg-type]
    assert re.search(rf"^{running[0].id} +local +{running[0].job_id} +ada +RUNNING +\S+ +\d+s *$", table, re.M), table
    wide = cli("job", "list", env={"COLUMNS": "140"}).stdout  # where there is room, the cluster too
    here = re.escape(os.uname().nodename)
    assert re.search(rf"^{running[0].id} +local +{here} +{running[0].job_id} +ada +RUNNING ", wide, re.M), wide
    mine = json.loads(cli("job", "list", "--user", "ada", "--json").stdout)  # type: ignore[arg-type]
    assert [r["attempt"] for r in mine] == [running[0].id], "squeue -u: the jobs ada submitted"
    # an account with nothing out now, as squeue -u prints; one lineage never saw is refused, as squeue
    # refuses an invalid user, naming the accounts it knows
    from orchestrator.provenance.invocation import current_user

    assert cli("job", "list", "-u", current_user()).stdout == "no jobs pending or running that match\n"  # type: ignore[union-attr]
    nobody = cli("job", "list", "-u", "bob")
    assert nobody.returncode == 2, nobody.stdout  # type: ignore[union-attr]
    assert nobody.stderr.startswith("error: --user 'bob': no run or job in lineage is that account's"), nobody.stderr  # type: ignore[union-attr]
    assert json.loads(cli("job", "status", running[0].id, "--json").stdout)["user"] == "ada"  # type: ignore[arg-type]
    cancelled = cli("job", "cancel", running[0].id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert runner.wait(30) == 143  # the runner exits with the job's code: 128 + SIGTERM
    assert store.get(Attempt, running[0].id).state == "CANCELLED"  # type: ignore[union-attr]
    assert cli("job", "list").stdout == "no jobs pending or running\n"  # type: ignore[union-attr]

    # the process that watched a job dies (SIGKILL) and the job ends on its own: `job list` asks the
    # backend, shows it ended and records its end, where lineage said RUNNING forever
    orphan = subprocess.Popen([*CLI, "job", "run", "-q", "--backend", "local", "--", "sh", "-c", "sleep 2; exit 3"])
    deadline = time.monotonic() + 30
    while not (watched := [a for a in store.list(Attempt) if a.state == "RUNNING"]):
        assert time.monotonic() < deadline, "the third job never showed up as RUNNING in lineage"
        time.sleep(0.1)
    orphan.kill()
    orphan.wait(10)
    time.sleep(3)
    assert store.get(Attempt, watched[0].id).state == "RUNNING"  # type: ignore[union-attr]
    listed = cli("job", "list")
    assert listed.returncode == 0, listed.stderr
    assert f"{watched[0].id}: ended; recorded now" in listed.stdout and " FAILED " in listed.stdout, listed.stdout
    ended = store.get(Attempt, watched[0].id)
    assert ended is not None and ended.state == "FAILED" and ended.exit_code == 3, ended
    assert cli("job", "list").stdout == "no jobs pending or running\n"  # type: ignore[union-attr]

    assert cli("job", "status", "att_nope").returncode == 2


def _answers_as_status(found: list[JobStatus | Exception], one_by_one: list[JobStatus]) -> None:
    """``statuses`` said of each job what ``status`` says of it alone."""
    for got, want in zip(found, one_by_one, strict=True):
        assert isinstance(got, JobStatus), got
        fields = ("state", "exit_code", "host", "reason", "started_at", "ended_at")
        assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields], (got, want)


@pytest.mark.slurm
def test_slurm_statuses_ask_squeue_once_and_answer_as_status_does(slurm_harness: Harness, store: LineageStore) -> None:
    """`job list` with hundreds of Slurm jobs out asked scontrol once per job; `statuses` asks one
    squeue for all, and only the jobs it cannot answer from that (one that ended, an array, one
    squeue forgot) one by one. Each answer is the one `status` gives."""
    launcher = slurm_harness.launcher
    spec = JobSpec(name="statuses", command=["sleep", "60"])
    running = launcher.submit(spec)
    held = launcher.submit(dataclasses.replace(spec, options={"extra_args": ["--hold"]}))
    ended = launcher.submit(JobSpec(name="statuses-ended", command=["sh", "-c", "exit 3"]))
    array = launcher.submit(JobSpec(name="statuses-array", command=["true"], options={"array": "0-1"}))
    forgotten = JobHandle("slurm", "999999")
    handles = [running, held, ended, array, forgotten]
    try:
        assert launcher.wait(ended, timeout=60).exit_code == 3
        launcher.wait(array, timeout=60)
        deadline = time.monotonic() + 30
        while launcher.status(running).state is not JobState.RUNNING:
            assert time.monotonic() < deadline, "the sleep job never started"
            time.sleep(0.2)
        asked: list[list[str]] = []
        real_run = launcher._run  # type: ignore[attr-defined]

        def spy(tool: str, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
            asked.append([tool, *args])
            return real_run(tool, *args, **kwargs)

        launcher._run = spy  # type: ignore[attr-defined]
        found = launcher.statuses(handles)
        by_squeue = [a for a in asked if a[0] == "squeue"]
        by_scontrol = {a[-1] for a in asked if a[:3] == ["scontrol", "show", "job"]}
        launcher._run = real_run  # type: ignore[attr-defined]
        one_by_one = [launcher.status(h) for h in handles]
        with store.transaction() as tx:  # what `job list` shows of them: squeue's NODELIST(REASON)
            evals = tx.add(StageRun(stage="eval", identity="i-held"))
            out = [
                tx.add(Attempt(backend="slurm", cluster=launcher.cluster, job_id=h.job_id, state="PENDING", **kw))
                for h, kw in ((running, {}), (held, {"stage_run_id": evals.id}))
            ]
        listed = {r["attempt"]: r for r in json.loads(cli("job", "list", "--json").stdout)}
        table = cli("job", "list", env={"COLUMNS": "100"}).stdout
        narrowed = {  # as squeue -t and -M narrow, and by the stage lineage knows
            args: [r["attempt"] for r in json.loads(cli("job", "list", "--json", *args).stdout)]
            for args in (("--state", "pending"), ("-t", "running"), ("--stage", "eval"))
        }
        elsewhere = cli("job", "list", "--cluster", "elsewhere")  # as squeue -M refuses a cluster it does not know
        # scancel -t PENDING: the held job goes, the running one (PENDING in lineage until asked) stays
        cancel_pending = cli("job", "cancel", "--state", "pending", "--yes")
        running_after = launcher.status(running).state
        held_after = store.get(Attempt, out[1].id)
        # an array out: one line with how far its tasks are, where squeue prints a line per task
        shards = launcher.submit(JobSpec(name="statuses-shards", command=["sleep", "60"], options={"array": "0-2"}))
        handles.append(shards)
        with store.transaction() as tx:
            sharded = tx.add(Attempt(backend="slurm", cluster=launcher.cluster, job_id=shards.job_id, state="PENDING"))
        (array_row,) = [r for r in json.loads(cli("job", "list", "--json").stdout) if r["attempt"] == sharded.id]
        array_table = cli("job", "list", env={"COLUMNS": "100"}).stdout
    finally:
        for handle in handles:
            if handle is not forgotten:
                launcher.cancel(handle)
    asked_for = ",".join(h.job_id for h in (running, held, ended, array, forgotten))
    assert len(by_squeue) == 1 and by_squeue[0][by_squeue[0].index("-j") + 1] == asked_for
    assert by_scontrol == {ended.job_id, array.job_id, forgotten.job_id}, asked  # not the running or held job
    assert [s.state for s in found] == [  # type: ignore[union-attr]
        JobState.RUNNING,
        JobState.PENDING,
        JobState.FAILED,
        JobState.SUCCEEDED,
        JobState.LOST,
    ], found
    _answers_as_status(found, one_by_one)
    assert found[1].reason == "JobHeldUser" and found[0].host  # type: ignore[union-attr]
    assert set(found[3].tasks or ()) == {"0", "1"}, found[3]  # type: ignore[union-attr]
    assert (listed[out[0].id]["state"], listed[out[0].id]["reason"]) == ("RUNNING", None), listed
    assert (listed[out[1].id]["state"], listed[out[1].id]["reason"]) == ("PENDING", "JobHeldUser"), listed
    assert re.search(rf"^{out[1].id} +slurm +{held.job_id} +eval +PENDING +\(JobHeldUser\) +\d+s *$", table, re.M), (
        table
    )
    assert re.search(rf"^{out[0].id} +slurm +{running.job_id} +RUNNING +{found[0].host} ", table, re.M), table
    assert sum(array_row["tasks"].values()) == 3 and set(array_row["tasks"]) <= {"RUNNING", "PENDING"}, array_row
    assert re.search(rf"^{sharded.id} +slurm +{shards.job_id} +(RUNNING|PENDING) 0/3 ", array_table, re.M), array_table
    assert cancel_pending.returncode == 0, cancel_pending.stderr
    assert cancel_pending.stdout.splitlines() == [
        "1 job(s) out that match:",
        f"  {out[1].id}  slurm job {held.job_id}  PENDING  eval  -",
        f"slurm job {held.job_id}: CANCELLED",
    ], cancel_pending.stdout
    assert running_after is JobState.RUNNING and held_after.state == "CANCELLED"  # type: ignore[union-attr]
    assert narrowed == {
        ("--state", "pending"): [out[1].id],  # the state squeue gives now; lineage said PENDING for both
        ("-t", "running"): [out[0].id],
        ("--stage", "eval"): [out[1].id],
    }, narrowed
    assert elsewhere.returncode == 2 and elsewhere.stderr.startswith(
        "error: --cluster 'elsewhere': no job in lineage ran on such a cluster"
    ), elsewhere.stderr


@pytest.mark.docker
def test_docker_statuses_read_each_image_once_and_answer_as_status_does(
    docker_harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`job list` with many Docker jobs of one image inspected the image once per job; `statuses`
    reads it once for all of them, and says of each job what `status` says of it alone."""
    from docker.models.images import ImageCollection

    launcher = docker_harness.launcher
    handles = [launcher.submit(JobSpec(name=f"statuses-{i}", command=["sleep", "60"])) for i in range(3)]
    try:
        deadline = time.monotonic() + 60
        while any(launcher.status(h).state is not JobState.RUNNING for h in handles):
            assert time.monotonic() < deadline, "the sleep jobs never started"
            time.sleep(0.2)
        images_read: list[str] = []
        real_get = ImageCollection.get

        def spy(self: Any, name: str) -> Any:
            images_read.append(name)
            return real_get(self, name)

        monkeypatch.setattr(ImageCollection, "get", spy)
        found = launcher.statuses(handles)
        asked_together = list(images_read)
        one_by_one = [launcher.status(h) for h in handles]
        alone = images_read[len(asked_together) :]
    finally:
        for handle in handles:
            launcher.cancel(handle)
    assert len(asked_together) == 1, asked_together  # one image, read once
    assert len(alone) == len(handles), "alone, each status reads it again"
    _answers_as_status(found, one_by_one)
    assert [s.image_digest for s in found] == [s.image_digest for s in one_by_one]  # type: ignore[union-attr]
    assert all(s.image_digest for s in one_by_one), one_by_one


def test_kubernetes_statuses_list_each_namespace_once_and_answer_as_status_does() -> None:
    """The same for Kubernetes: one list of openlab's Jobs and one of their pods per namespace,
    where one by one it was a read and a list per job; a Job the list lacks is read by itself."""
    from tests.launchers.k8s_emulator import EmulatedCluster

    cluster = EmulatedCluster(runtime="process").start()
    try:
        launcher = get_launcher("kubernetes", host=cluster.url)
        launcher.poll_interval = 0.1
        running = launcher.submit(JobSpec(name="statuses", command=["sleep", "60"]))
        done = launcher.submit(JobSpec(name="statuses-done", command=["true"]))
        failed = launcher.submit(JobSpec(name="statuses-failed", command=["sh", "-c", "exit 3"]))
        gone = JobHandle("kubernetes", f"{running.job_id.partition('/')[0]}/openlab-gone-1234")
        handles = [running, done, failed, gone]
        assert launcher.wait(done, timeout=60).state is JobState.SUCCEEDED
        assert launcher.wait(failed, timeout=60).exit_code == 3
        deadline = time.monotonic() + 30
        while launcher.status(running).state is not JobState.RUNNING:
            assert time.monotonic() < deadline, "the sleep job never started"
            time.sleep(0.1)
        asked: list[str] = []
        real_call = launcher._call

        def spy(what: str, fn: Any, **kwargs: Any) -> Any:
            asked.append(what)
            return real_call(what, fn, **kwargs)

        launcher._call = spy  # type: ignore[method-assign]
        found = launcher.statuses(handles)
        launcher._call = real_call  # type: ignore[method-assign]
        one_by_one = [launcher.status(h) for h in handles]
        from orchestrator.launchers.kubernetes import API_NEEDS

        granted = {(group, resource, verb) for group, resource, verbs, _ in API_NEEDS for verb in verbs}
        with cluster.rbac(granted - {("batch", "jobs", "list")}):  # a Role without it: one by one, as before
            refused = launcher.statuses(handles)
        launcher.cancel(running)
    finally:
        cluster.stop()
    namespace = running.job_id.partition("/")[0]
    assert asked == [
        f"list Jobs in namespace {namespace}",
        f"list pods in namespace {namespace}",
        f"read Job {gone.job_id}",
    ]
    assert [s.state for s in found] == [  # type: ignore[union-attr]
        JobState.RUNNING,
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.LOST,
    ], found
    _answers_as_status(found, one_by_one)
    assert [s.state for s in refused] == [s.state for s in one_by_one], refused  # type: ignore[union-attr]


def test_job_cancel_takes_several_ids_and_names_the_one_it_could_not_cancel(store: LineageStore) -> None:
    """As `scancel 41 42 43`: each job cancelled on its own, a bad id named on stderr without
    keeping the others alive, exit 2."""
    launcher = get_launcher("local")
    jobs = [launcher.submit(JobSpec(name=f"cancel-{i}", command=["sleep", "60"])) for i in range(2)]
    try:
        done = cli("job", "cancel", jobs[0].job_id, "local-nope", jobs[1].job_id, "--backend", "local")
        states = [launcher.status(j).state for j in jobs]
    finally:
        for job in jobs:
            launcher.cancel(job)
    assert done.returncode == 2, done.stderr
    assert done.stdout.splitlines() == [f"local job {j.job_id}: CANCELLED" for j in jobs], done.stdout
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: local-nope: "), done.stderr
    assert states == [JobState.CANCELLED, JobState.CANCELLED], states


def test_job_list_names_what_it_could_not_ask_and_still_lists_the_rest(store: LineageStore, tmp_path: Path) -> None:
    """One unreachable cluster must not hide the other backends' jobs; a job its scheduler forgot is
    recorded as ended; an attempt still being submitted is not called a failed submission."""
    with store.transaction() as tx:
        k8s = tx.add(Attempt(backend="kubernetes", job_id="default/openlab-x", state="RUNNING"))
        forgotten = tx.add(Attempt(backend="slurm", job_id="999999", state="PENDING"))
        submitting = tx.add(Attempt(backend="local", state="PENDING"))
    jobcomp = tmp_path / "jobcomp.log"
    jobcomp.write_text("")
    jobcomp_only_slurm(tmp_path / "bin", jobcomp)  # a cluster that has forgotten job 999999
    env = {
        "OPENLAB_BACKENDS__KUBERNETES__HOST": "http://127.0.0.1:9",
        "OPENLAB_BACKENDS__KUBERNETES__RETRIES": "0",
        "OPENLAB_BACKENDS__SLURM__BIN_DIR": str(tmp_path / "bin"),
    }
    listed = cli("job", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = {r["attempt"]: r for r in json.loads(listed.stdout)}
    assert rows[k8s.id]["state"] == "RUNNING" and "kubernetes API at http://127.0.0.1:9 not reachable" in (
        rows[k8s.id]["note"] or ""
    ), rows
    assert rows[forgotten.id]["state"] == "LOST" and rows[forgotten.id]["note"].startswith("ended; recorded now")
    assert rows[submitting.id]["note"].startswith("no job id yet"), rows
    assert store.get(Attempt, forgotten.id).state == "LOST"  # type: ignore[union-attr]
    assert store.get(Attempt, k8s.id).state == "RUNNING"  # type: ignore[union-attr]
    ended = cli("job", "list", "--state", "failed")  # a job out is pending or running: say where ended ones are
    assert ended.returncode == 2 and ended.stderr.strip().splitlines() == [
        "error: --state 'failed': states of a job out: pending, running "
        "(ended jobs: openlab lineage list --kind attempt --state FAILED)"
    ], ended.stderr
    assert cli("job", "list", "--stage", "pretrain").stdout == "no jobs pending or running that match\n"
    misspelt = cli("job", "list", "--backend", "kubernets")  # listed nothing: "no jobs out" was a lie
    assert misspelt.returncode == 2 and misspelt.stderr.strip().splitlines() == [
        "error: --backend 'kubernets': not a backend; did you mean 'kubernetes'? " + KNOWN
    ], misspelt.stderr


def test_job_cancel_by_user_cancels_that_accounts_jobs_out_once_agreed(store: LineageStore, run_cli_tty) -> None:
    """`openlab job cancel --user ada`, as `scancel -u ada`: the jobs ada submitted that are out,
    listed, and cancelled only with --yes when there is no terminal to ask on; bob's run on."""
    runners = {
        who: subprocess.Popen(
            [*CLI, "job", "run", "-q", "--backend", "local", "--", "sleep", "60"],
            env={**os.environ, "LOGNAME": who},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for who in ("ada", "bob")
    }
    try:
        deadline = time.monotonic() + 30
        while len(out := [a for a in store.list(Attempt) if a.state == "RUNNING"]) < 2:
            assert time.monotonic() < deadline, "the two jobs never showed up as RUNNING in lineage"
            time.sleep(0.2)
        ada = next(a for a in out if a.user == "ada")
        bob = next(a for a in out if a.user == "bob")

        asked = cli("job", "cancel", "--user", "ada")  # no terminal here: refused, nothing cancelled
        assert asked.returncode == 2, asked.stdout + asked.stderr
        assert f"{ada.id}  local job {ada.job_id}  RUNNING  -  ada" in asked.stdout and bob.id not in asked.stdout
        assert asked.stderr.strip() == "error: 1 job(s) match and nothing was cancelled: add --yes to cancel them"
        assert {a.state for a in store.list(Attempt)} == {"RUNNING"}
        # at a terminal it asks; "no" cancels nothing
        code, shown = run_cli_tty("job", "cancel", "--user", "ada", answer="n")
        assert code == 1 and "cancel these 1 job(s)? [y/N]: error: nothing was cancelled" in shown, shown
        assert {a.state for a in store.list(Attempt)} == {"RUNNING"}

        code, shown = run_cli_tty("job", "cancel", "-u", "ada", answer="y")
        assert code == 0 and f"local job {ada.job_id}: CANCELLED" in shown, shown
        assert runners["ada"].wait(30) == 143
        assert store.get(Attempt, ada.id).state == "CANCELLED"  # type: ignore[union-attr]
        assert store.get(Attempt, bob.id).state == "RUNNING"  # type: ignore[union-attr]
        assert runners["bob"].poll() is None, "bob's job runs on"
        assert cli("job", "cancel", "-u", "ada", "--yes").stdout == "no jobs pending or running that match\n"

        both = cli("job", "cancel", bob.id, "--user", "bob")
        assert both.returncode == 2 and both.stderr.strip() == (
            "error: give job ids or filters (--user, --stage ...), not both"
        )
        ended = cli("job", "cancel", "-t", "completed", "--yes")  # scancel -t takes only states a job out has
        assert ended.returncode == 2 and ended.stderr.startswith("error: --state 'completed': "), ended.stderr
        assert "Traceback" not in ended.stderr and runners["bob"].poll() is None
        none = cli("job", "cancel")
        assert none.returncode == 2 and "name the jobs to cancel" in none.stderr and "Traceback" not in none.stderr
    finally:  # whatever failed, no job is left running
        for attempt in store.list(Attempt):
            if attempt.state in ("PENDING", "RUNNING"):
                cli("job", "cancel", attempt.id)
        for runner in runners.values():
            runner.wait(30)


@pytest.mark.slurm
def test_a_slurm_client_without_its_configuration_says_where_to_point_it(store: LineageStore) -> None:
    """The first thing that goes wrong on a new login node: the Slurm client finds no slurm.conf.
    scontrol's own four lines (a DNS SRV lookup, then "fatal") become one that says what to set;
    a SLURM_CONF naming a missing file is refused at once, where the client retries for a minute."""
    from tests.services import require_slurm

    require_slurm()
    missing = cli("backends", "check", "slurm", "--json", env={"SLURM_CONF": "/nonexistent/slurm.conf"}, timeout=30)
    (row,) = json.loads(missing.stdout)
    assert row["reachable"] is False and row["detail"] == (
        "SLURM_CONF is /nonexistent/slurm.conf, which does not exist: point it (or slurm_conf under "
        "[backends.slurm]) at the cluster's slurm.conf"
    ), row
    job = cli("job", "run", "-b", "slurm", "-q", "--", "true", env={"SLURM_CONF": "/nonexistent/slurm.conf"})
    assert job.returncode == 2 and job.stderr.startswith("error: SLURM_CONF is /nonexistent/slurm.conf"), job.stderr
    assert "Traceback" not in job.stderr and len(job.stderr.strip().splitlines()) == 1
    if Path("/etc/slurm/slurm.conf").exists():  # the client's compiled-in default: it has a configuration
        return
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    unset = subprocess.run([*CLI, "backends", "check", "slurm", "--json"], capture_output=True, text=True, env=env)
    (row,) = json.loads(unset.stdout)  # the real scontrol, with nothing to read
    assert row["detail"].startswith("the Slurm client found no configuration (scontrol: Could not establish"), row
    assert row["detail"].endswith(
        "set SLURM_CONF to the cluster's slurm.conf, or slurm_conf under [backends.slurm] in openlab.toml"
    )


def test_cli_backends_check_json(tmp_path: Path) -> None:
    proc = cli(
        "backends",
        "check",
        "--json",
        "local",
        "kubernetes",
        env={"OPENLAB_BACKENDS__KUBERNETES__HOST": "http://127.0.0.1:9", "OPENLAB_BACKENDS__KUBERNETES__RETRIES": "0"},
    )
    assert proc.returncode == 0, proc.stderr
    rows = {r["backend"]: r for r in json.loads(proc.stdout)}
    assert rows["local"]["reachable"] is True
    assert rows["kubernetes"]["reachable"] is False and "not reachable" in rows["kubernetes"]["detail"]
    assert rows["local"]["default"] is True and rows["kubernetes"]["default"] is False  # no [backends] default: local
    # the name each backend's attempts will record as where they ran; none for one that is down
    assert rows["local"]["cluster"] == os.uname().nodename and rows["kubernetes"]["cluster"] is None
    table = cli("backends", "check", "local", env={"OPENLAB_BACKENDS__DEFAULT": "Local", "COLUMNS": "120"})
    assert "local (default)" in table.stdout, table.stdout


def test_slurm_status_falls_back_to_jobcomp_when_scontrol_forgot_the_job(tmp_path: Path) -> None:
    """After MinJobAge scontrol no longer knows a job; without slurmdbd sacct fails; jobcomp/filetxt remains."""
    jobcomp = tmp_path / "jobcomp.log"
    jobcomp.write_text(
        "JobId=77 UserId=root(0) GroupId=root(0) Name=train JobState=TIMEOUT Partition=debug TimeLimit=1 "
        "StartTime=2026-12-02T19:06:52 EndTime=2026-12-02T19:08:01 NodeList=node7 NodeCnt=1 ProcCnt=1 "
        "WorkDir=/work ReservationName= Tres=cpu=1,mem=100M,node=1,billing=1 Account= QOS= WcKey= Cluster=unknown "
        "SubmitTime=2026-12-02T19:06:50 EligibleTime=2026-12-02T19:06:50 DerivedExitCode=0:0 ExitCode=0:15 \n"
    )
    bin_dir = _fake_slurm(tmp_path, "exit 99\n")
    jobcomp_only_slurm(bin_dir, jobcomp)
    launcher = get_launcher("slurm", bin_dir=str(bin_dir))
    status = launcher.status(JobHandle("slurm", "77"))
    assert status.state is JobState.FAILED and status.reason == "time limit exceeded"
    assert status.host == "node7" and status.exit_code == 128 + 15
    assert status.started_at is not None and status.ended_at is not None
    assert launcher.status(JobHandle("slurm", "78")).state is JobState.LOST


def test_the_error_line_a_failed_jobs_reason_ends_with() -> None:
    """Which log line is "why it failed": the last one naming an error, whatever task labelled it,
    with secret values masked and a runaway line cut; none when no line names one or the log is gone."""
    from orchestrator.launchers.attempts import error_line

    class Logs:
        name = "fake"

        def __init__(self, lines: list[str] | None) -> None:
            self.lines = lines

        def logs(self, handle: JobHandle, *, follow: bool = False, tail: int | None = None):  # noqa: ANN202
            if self.lines is None:
                raise OSError("log file gone")
            return iter(self.lines[-(tail or len(self.lines)) :])

    handle = JobHandle("fake", "1")

    def said(lines: list[str] | None, secrets: list[str] = ()) -> str | None:  # type: ignore[assignment]
        return error_line(Logs(lines), handle, list(secrets))  # type: ignore[arg-type]

    traceback = ["step 3/9", "Traceback (most recent call last):", '  File "t.py", line 1', "ValueError: lr < 0"]
    assert said([*traceback, "cleaning up"]) == "ValueError: lr < 0"
    assert said(["1: torch.OutOfMemoryError: CUDA out of memory", "0: step 4/9"]) == (
        "torch.OutOfMemoryError: CUDA out of memory"
    )
    assert said(["[3] error: shard 3 is empty"]) == "error: shard 3 is empty"  # an array task's line
    assert said(["error: token hunter2secret refused"], ["hunter2secret"]) == "error: token *** refused"
    assert said(["RuntimeError: " + "x" * 500]).endswith("…") and len(said(["RuntimeError: " + "x" * 500])) == 300
    assert said(["ERROR:root:no shards under /data", "INFO:root:bye"]) == "ERROR:root:no shards under /data"
    assert said(["[ERROR] checkpoint dir is read-only"]) == "[ERROR] checkpoint dir is read-only"
    pulled = "docker: Error response from daemon: pull access denied for ghcr.io/lab/eval."
    assert said([pulled, "See 'docker run --help'."]) == pulled  # a job that runs containers itself
    # a line that only mentions the word is not why it failed: the earlier reason stands
    assert said(["fatal: no such ref", "error rate 0.31 at step 9", "Error analysis follows"]) == "fatal: no such ref"
    assert said(["step 9/9", "bye"]) is None and said([]) is None
    assert said(None) is None  # an unreadable log leaves the reason as it was
