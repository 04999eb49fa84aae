"""Local backend: the job is a process on this machine, in its own process group.

A tiny stdlib supervisor (:mod:`orchestrator.launchers._supervise`) is the job's parent:
it keeps the time limit, ends the whole process group on cancel (SIGTERM, then SIGKILL
after ``grace`` seconds) and writes the outcome into ``$OPENLAB_HOME/jobs/local/ID.run.json``
beside the launcher's own ``ID.json`` (what was asked: command, labels, supervisor pid), so
any process can ask for the status of a job it did not start. Output goes to
``logs_dir/ID.log``: straight from the job, or, where the job's environment holds secret values
(``-e MY_TOKEN=...``, an inherited ``WANDB_API_KEY``), through the supervisor, which writes it
with each of them replaced by ``***`` as it comes, so no secret ever reaches the file (and so
neither ``job logs`` nor anyone reading the file sees one).

Waiting costs no poll latency: the supervisor exits right after writing the outcome, and
:meth:`LocalLauncher.pause` waits on a pidfd of the supervisor, so :meth:`wait` and log
following wake the moment a job ends instead of at the next poll (where pidfds are
missing it sleeps, as other backends do).

A job that asks for GPUs gets GPUs no other local job holds (``CUDA_VISIBLE_DEVICES``), and waits,
PENDING with the holders named, until enough are free (the supervisor keeps a ledger of who holds
which): two stages of a sweep on one workstation each on GPU 0 would both run out of its memory.
The GPUs are ``[backends.local] gpus`` (a count or a list of ids), else the ones this process may use
(``CUDA_VISIBLE_DEVICES``), else those ``nvidia-smi`` lists; where none are known, ``0..N-1`` as before.

Config (``[backends.local]``): ``grace`` (seconds between SIGTERM and SIGKILL, default 30: ``STOP_GRACE``),
``inherit_env`` (pass this process's environment to jobs, default true), ``gpus`` (above).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.launchers import _supervise
from orchestrator.launchers._tasks import command as tasks_command
from orchestrator.launchers.base import (
    STOP_GRACE,
    Backoff,
    JobHandle,
    JobNotFound,
    JobSpec,
    JobState,
    JobStatus,
    Launcher,
    LauncherError,
    first_failed_task,
    flag_option,
    number_option,
    task_ends_prefix,
    with_notes,
)
from orchestrator.secrets import redact_argv, scrub

SUPERVISOR = Path(__file__).with_name("_supervise.py")
GPUS_EXAMPLE = '[backends.local] gpus = 4 (GPUs 0-3), or a list of ids: gpus = ["0", "2"]'


def gpu_ids_option(opts: Mapping[str, Any]) -> list[str] | None:
    """``gpus`` as the ids of the GPUs local jobs share (a count ``n``: ``0``..``n-1``); None when
    unset or ``"auto"``. Anything else is refused in one line."""
    raw = opts.get("gpus", "auto")
    if raw == "auto" or raw is None:
        return None
    if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
        return [str(i) for i in range(raw)]
    if isinstance(raw, list) and all(isinstance(i, (str, int)) and not isinstance(i, bool) for i in raw):
        ids = [str(i).strip() for i in raw]
        if all(ids) and len(set(ids)) == len(ids) and not any("," in i or "\t" in i or ":" in i for i in ids):
            return ids
    raise ConfigError(f"backend option gpus = {raw!r} is not GPUs: give {GPUS_EXAMPLE}, or 'auto'")


_COMPILED: dict[Path, str] = {}


def supervisor_program(state_dir: Path) -> str:
    """The supervisor as a ``.pyc`` for this interpreter (compiled once per source), else its ``.py``.

    A script run by path is compiled on every start — ~4 ms of a supervisor's ~25 ms on a
    busy machine, paid by every local job. The ``.pyc`` is named by the source's hash and
    the interpreter's cache tag, so an edited supervisor or another Python never runs a
    stale one; any failure falls back to the source.
    """
    if state_dir in _COMPILED:
        return _COMPILED[state_dir]
    import hashlib
    import py_compile

    program = str(SUPERVISOR)
    try:
        digest = hashlib.sha256(SUPERVISOR.read_bytes()).hexdigest()[:16]
        target = state_dir / f"_supervise-{sys.implementation.cache_tag}-{digest}.pyc"
        if not target.exists():
            py_compile.compile(str(SUPERVISOR), cfile=str(target), doraise=True)
        program = str(target)
    except (OSError, py_compile.PyCompileError):
        pass
    _COMPILED[state_dir] = program
    return program


def _ts(value: Any) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(float(value), dt.UTC) if value else None


def _alive(pid: int | None) -> bool:
    """Whether ``pid`` is a live process, a zombie not: the supervisor's own rule, which its GPU ledger uses."""
    return bool(pid) and _supervise.alive(pid)


def _group_alive(pgid: int | None) -> bool:
    return bool(pgid) and _supervise.group_alive(pgid)


def follow_file(
    path: Path,
    done: Any,
    *,
    follow: bool,
    tail: int | None,
    poll: float = 0.1,
    pause: Callable[[float], None] = time.sleep,
) -> Iterator[str]:
    """Lines of a growing log file; with ``follow`` until ``done()`` is true and the file is drained.

    ``pause(seconds)`` waits between looks at an idle file; a launcher passes one that
    returns as soon as the job ends, so following the log of a finished job ends at once.
    A file that shrinks or is replaced while followed was started again (Slurm truncates a
    requeued job's output when the job restarts): the follower goes on from its beginning, as
    ``tail -F`` does, after a line that says so, instead of waiting for ever past its end.
    A file not there yet is waited for as long as the job has not ended: a Slurm job queued for
    hours writes nothing until it starts (the follower gave up after 30 s, and ``openlab job run``
    and ``job logs -f`` showed none of its output).
    """
    while not path.exists():
        if not follow:
            return
        if done():
            # A short job can start, write its log and end while done() asks (a Slurm query
            # takes long under load): look once more before concluding it wrote nothing.
            if not path.exists():
                return
            break
        time.sleep(poll)
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        if tail is not None:
            last = deque(fh, maxlen=max(tail, 0))
            pending = "".join(last)
            for line in pending.splitlines():
                yield line
            if not follow:
                return
        elif not follow:
            for line in fh:
                yield line.rstrip("\n")
            return
        partial = ""
        backoff = Backoff(poll)
        while True:
            chunk = fh.readline()
            if chunk:
                backoff.reset()
                partial += chunk
                if partial.endswith("\n"):
                    yield partial[:-1]
                    partial = ""
                continue
            if _restarted(path, fh):
                if partial:
                    yield partial
                yield f"[openlab] {path.name} was started again (the job restarted); following it from the top"
                yield from follow_file(path, done, follow=True, tail=None, poll=poll, pause=pause)
                return
            if done():
                rest = fh.read()
                text = partial + rest
                for line in text.splitlines():
                    yield line
                return
            pause(backoff.next_delay())


def _restarted(path: Path, fh: Any) -> bool:
    """Whether the file at ``path`` is now shorter than what ``fh`` has read, or another file."""
    try:
        now = path.stat()
        mine = os.fstat(fh.fileno())
    except OSError:
        return False
    return (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev) or mine.st_size < fh.buffer.tell()


class LocalLauncher(Launcher):
    """Runs jobs as local processes (see the module docstring)."""

    name = "local"
    #: Several tasks of one job on this machine (launchers/_tasks.py), never several machines.
    multi_task = True
    #: Longest gap between status looks; :meth:`pause` wakes on the job's end (a pidfd), so this
    #: bounds only how soon a cancel request is acted on, and the lateness where pidfds are missing.
    poll_interval = 0.5
    known_options = Launcher.known_options | {"grace", "inherit_env", "gpus"}

    @classmethod
    def check_options(cls, opts: Mapping[str, Any]) -> None:
        super().check_options(opts)
        number_option(opts, "grace", STOP_GRACE)
        flag_option(opts, "inherit_env", True)
        gpu_ids_option(opts)

    def gpu_ids(self) -> list[str]:
        """This machine's GPUs that local jobs share out (module docstring): ``[backends.local] gpus``,
        else the ones this process may use (``CUDA_VISIBLE_DEVICES``), else those ``nvidia-smi`` lists;
        none known: a job asking for GPUs gets ``CUDA_VISIBLE_DEVICES`` 0..N-1, as before."""
        given = gpu_ids_option(self.config)
        if given is not None:
            return given
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        if visible:
            return [v.strip() for v in visible.split(",") if v.strip()]
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return []
        try:
            done = subprocess.run(
                [smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []

    def __init__(self, settings: Any = None, config: Any = None) -> None:
        super().__init__(settings, config)
        self.state_dir = self.settings.home / "jobs" / "local"
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    # -- helpers ---------------------------------------------------------------
    def _find_cluster(self) -> str | None:
        return os.uname().nodename  # a local job is processes and state files on this machine

    def _state_path(self, job_id: str) -> Path:
        if not job_id.startswith("local-") or "/" in job_id:
            raise JobNotFound(f"{job_id!r} is not a local job id (local-...)")
        return self.state_dir / f"{job_id}.json"

    def _run_path(self, job_id: str) -> Path:
        """The supervisor's file: state, pgid, host, start, end, exit code, reason."""
        return self.state_dir / f"{job_id}.run.json"

    @staticmethod
    def _load(path: Path) -> dict[str, Any] | None:
        """A JSON file's dict, None when it does not exist."""
        for _ in range(3):
            try:
                return dict(json.loads(path.read_text()))
            except FileNotFoundError:
                return None
            except json.JSONDecodeError:
                time.sleep(0.02)  # replaced atomically, but be forgiving
        raise LauncherError(f"local job state file {path} is unreadable")

    def _read(self, job_id: str) -> dict[str, Any]:
        """What was submitted (``ID.json``) overlaid with what the supervisor recorded (``ID.run.json``)."""
        path = self._state_path(job_id)
        state = self._load(path)
        if state is None:
            raise JobNotFound(f"no local job {job_id} (no state file {path})")
        state.update(self._load(self._run_path(job_id)) or {})
        return state

    @staticmethod
    def _write_state(path: Path, state: dict[str, Any]) -> None:
        """Write a job's ``ID.json`` whole (through a temporary file), never half."""
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(state))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _reap(self, job_id: str) -> None:
        child = self._children.get(job_id)
        if child is not None and child.poll() is not None:
            self._children.pop(job_id, None)

    # -- interface -------------------------------------------------------------
    def submit(self, spec: JobSpec) -> JobHandle:
        job_id = f"local-{uuid.uuid4().hex[:12]}"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        logs_dir = self.settings.logs_dir
        logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = logs_dir / f"{job_id}.log"
        workdir = spec.workdir
        if workdir and not Path(workdir).is_dir():
            raise LauncherError(f"working directory {workdir} does not exist")
        env = (
            dict(os.environ) if flag_option(self.config, "inherit_env", True) else {"PATH": os.environ.get("PATH", "")}
        )
        env.update(spec.env)
        env.update(
            OPENLAB_JOB_ID=job_id,
            OPENLAB_JOB_NAME=spec.name,
            OPENLAB_LABELS=json.dumps(dict(spec.labels), sort_keys=True),
        )
        if spec.artifact_root is not None:
            Path(spec.artifact_root).mkdir(parents=True, exist_ok=True)
            env["OPENLAB_ARTIFACT_ROOT"] = str(spec.artifact_root)
        gpu_ids = self.gpu_ids() if spec.gpus else []
        if spec.gpus and gpu_ids:  # GPUs no other local job holds, waited for by the supervisor
            if spec.gpus > len(gpu_ids):
                raise LauncherError(
                    f"the job asks for {spec.gpus} GPUs and this machine has {len(gpu_ids)} ({', '.join(gpu_ids)}); "
                    "ask for fewer, or set [backends.local] gpus to the GPUs local jobs may use"
                )
            env.pop("CUDA_VISIBLE_DEVICES", None)
            env["OPENLAB_GPUS"] = f"{spec.gpus}:{','.join(gpu_ids)}"
            env["OPENLAB_GPU_LEDGER"] = str(self.state_dir / "gpus.held")
        elif spec.gpus:
            env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(spec.gpus)))
        command = list(spec.command)
        if spec.tasks > 1:  # one process per task, told its place, as srun does (launchers/_tasks.py)
            env["OPENLAB_TASK_ENDS"] = task_ends_prefix(log_path)
            env["OPENLAB_STOP_FIRST_PROCESS"] = "1"  # the runner passes a stop on: each task gets it once
            command = tasks_command(sys.executable, spec.tasks, command)
        secrets = spec.secret_values()
        state: dict[str, Any] = {
            "job_id": job_id,
            "name": scrub(spec.name, secrets),  # a name or a folder typed with a secret's value in it
            "command": redact_argv(spec.command, secrets),  # what ran, as lineage records it
            "labels": dict(spec.labels),
            "workdir": scrub(workdir, secrets) if workdir else workdir,
            "log_path": str(log_path),
            "time_limit": spec.time_limit,
            "state": "PENDING",
            "submitted_at": time.time(),
            "host": os.uname().nodename,
            # the job's own (a recipe's stage option may set it), which a cancel waits out as the supervisor does
            "grace": number_option({**self.config, **spec.options}, "grace", STOP_GRACE),
        }
        grace = state["grace"]
        path = self._state_path(job_id)
        # written before the start as well, so that a submitter killed right after it (SIGKILL: no
        # clean-up runs) leaves a job the reaper can find by its labels (:meth:`find`) and stop
        self._write_state(path, state)
        argv = [
            sys.executable,
            "-I",
            "-S",
            supervisor_program(self.state_dir),
            str(self._run_path(job_id)),
            str(spec.time_limit or 0),
            str(spec.warn_before_limit or 0),
            str(grace),
            workdir or "",
            "--",
        ]
        with log_path.open("ab") as log_fh:
            try:
                child = subprocess.Popen(
                    [*argv, *command],
                    stdin=subprocess.DEVNULL,
                    stdout=log_fh,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as exc:
                path.unlink(missing_ok=True)
                raise LauncherError(f"cannot start local job: {exc}") from None
            except BaseException:
                path.unlink(missing_ok=True)
                raise
        self._children[job_id] = child
        # written again after the start, with the supervisor's pid: the supervisor never touches
        # this file (it writes ID.run.json), and nobody knows the job id before we return
        state["supervisor_pid"] = child.pid
        try:
            self._write_state(path, state)
        except BaseException:  # Ctrl-C, a full disk: no caller learns the job id, so the job must not run
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGTERM)  # the supervisor stops the job (its own group), then exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=grace + 3)
            path.unlink(missing_ok=True)
            raise
        return JobHandle(self.name, job_id, str(log_path), {"supervisor_pid": child.pid})

    def _supervisor_pid(self, job_id: str, state: dict[str, Any]) -> int | None:
        pid = state.get("supervisor_pid")
        if pid:
            return int(pid)
        try:  # jobs submitted by openlab before the pid moved into ID.json
            return int(json.loads(self._state_path(job_id).with_suffix(".pid").read_text())["supervisor_pid"])
        except (OSError, ValueError, KeyError):
            pass
        # its submitter died before either file had the pid (SIGKILL right after the start): the supervisor
        # is the process whose command line names this job's run file; a cancel must reach it, or it starts
        # the job after the cancel was recorded
        run_path = str(self._run_path(job_id)).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if run_path in argv:
                return int(entry.name)
        return None

    def pause(self, handle: JobHandle, seconds: float) -> None:
        """Sleep up to ``seconds``, waking as soon as the job's supervisor exits (a pidfd).

        The supervisor exits right after recording the outcome, so a waiter sees the end
        within microseconds instead of at its next poll — for a short job that poll was
        most of the launcher's overhead. Works from any process (pidfds need no parentage);
        without pidfd support (not Linux, kernel < 5.3) it sleeps.
        """
        if seconds <= 0:
            return
        pid = handle.extra.get("supervisor_pid")
        if not pid:
            try:
                pid = self._supervisor_pid(handle.job_id, self._read(handle.job_id))
            except LauncherError:
                pid = None
        if not pid or not hasattr(os, "pidfd_open"):
            time.sleep(seconds)
            return
        try:
            fd = os.pidfd_open(int(pid))
        except ProcessLookupError:
            return  # already gone: the caller's next look sees the outcome
        except OSError:
            time.sleep(seconds)
            return
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll(seconds * 1000)  # readable once the process has exited
        finally:
            os.close(fd)

    def status(self, handle: JobHandle) -> JobStatus:
        self._reap(handle.job_id)
        state = self._read(handle.job_id)
        job_state = JobState(state.get("state", "PENDING"))
        if not job_state.terminal:
            sup = self._supervisor_pid(handle.job_id, state)
            self._reap(handle.job_id)
            if sup is not None and not _alive(sup):
                state = self._read(handle.job_id)  # it may have finished just now
                job_state = JobState(state.get("state", "PENDING"))
                if not job_state.terminal:
                    job_state = JobState.LOST
                    state["reason"] = "the job's supervisor process is gone without recording an end"
                    if self._end_orphans(handle.job_id, state):
                        state["reason"] += (
                            "; its processes, left running with no one to time, stop or record them, were ended"
                        )
        reason = state.get("reason")
        if job_state.terminal and state.get("exit_code"):
            log_path = handle.log_path or state.get("log_path")
            reason = with_notes(reason, first_failed_task(task_ends_prefix(log_path) if log_path else None))
        return JobStatus(
            state=job_state,
            exit_code=state.get("exit_code"),
            reason=reason,
            host=state.get("host"),
            started_at=_ts(state.get("started_at")),
            ended_at=_ts(state.get("ended_at")),
            usage={k: state[k] for k in ("max_rss_bytes", "cpu_seconds") if k in state} or None,
        )

    def logs(self, handle: JobHandle, *, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        path = Path(handle.log_path or self._read(handle.job_id)["log_path"])
        return follow_file(
            path,
            lambda: self.status(handle).state.terminal,
            follow=follow,
            tail=tail,
            pause=lambda seconds: self.pause(handle, seconds),
        )

    def find(self, labels: Mapping[str, str]) -> list[JobHandle]:
        wanted = {str(k): str(v) for k, v in labels.items()}
        found = []
        for path in sorted(self.state_dir.glob("local-*.json")):
            if path.name.endswith(".run.json"):
                continue
            try:
                state = self._load(path) or {}
            except LauncherError:
                continue
            have = state.get("labels") or {}
            if all(have.get(k) == v for k, v in wanted.items()):
                job_id = path.name.removesuffix(".json")
                found.append(JobHandle(self.name, job_id, state.get("log_path")))
        return found

    def _end_orphans(self, job_id: str, state: dict[str, Any]) -> bool:
        """End the processes of a job whose supervisor was killed (SIGKILL, the OOM killer): they
        outlive it in their own process group, unsupervised, and a job reported LOST is run again
        by its pipeline, so two would write the same output folder. The group is ended only if its
        leader is still this job's (its environment names the job), never a group whose id a later
        process took. True when there was one to end."""
        pgid = int(state.get("pgid") or 0)
        if not pgid or not _group_alive(pgid):
            return False
        try:
            environ = Path(f"/proc/{pgid}/environ").read_bytes().split(b"\0")
        except OSError:  # the leader is gone (its children may linger) or not ours to read: leave it
            return False
        if f"OPENLAB_JOB_ID={job_id}".encode() not in environ:
            return False
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def cancel(self, handle: JobHandle) -> None:
        self._reap(handle.job_id)  # a supervisor killed before (the OOM killer) is not left a zombie
        state = self._read(handle.job_id)
        if JobState(state.get("state", "PENDING")).terminal:
            return
        sup = self._supervisor_pid(handle.job_id, state)
        grace = float(state.get("grace") or number_option(self.config, "grace", STOP_GRACE))
        if sup is not None and _alive(sup):
            try:
                os.kill(sup, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace + 3
            while time.monotonic() < deadline:
                self._reap(handle.job_id)
                if JobState(self._read(handle.job_id).get("state", "PENDING")).terminal or not _alive(sup):
                    break  # recorded, or the supervisor died before it could (killed while starting)
                self.pause(handle, 0.05)
        # the supervisor is gone or stuck, or members linger: end the group ourselves
        state = self._read(handle.job_id)
        pgid = int(state.get("pgid") or 0)
        if _group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if sup is not None and _alive(sup):
            try:
                os.kill(sup, signal.SIGKILL)
            except ProcessLookupError:  # it finished between the check and the kill
                pass
        if not JobState(state.get("state", "PENDING")).terminal:
            # the supervisor is dead by now, so its file is ours to finish
            run = self._load(self._run_path(handle.job_id)) or {}
            run.update(state="CANCELLED", reason="cancelled (supervisor did not answer)", ended_at=time.time())
            self._run_path(handle.job_id).write_text(json.dumps(run))

    def check(self) -> tuple[bool, str]:
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            probe = self.state_dir / ".probe"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            return False, f"cannot write job state under {self.state_dir}: {exc.strerror}"
        return True, f"processes on {os.uname().nodename} (state in {self.state_dir})"

    def process_group(self, handle: JobHandle) -> int | None:
        """The job's process group id (tests check nothing of it is left after cancel)."""
        pgid = self._read(handle.job_id).get("pgid")
        return int(pgid) if pgid else None

    def cleanup(self, handle: JobHandle) -> None:
        self._reap(handle.job_id)
