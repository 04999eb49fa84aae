"""Slurm backend: ``sbatch --parsable`` with a generated batch script, then the Slurm CLI.

- The batch script carries ``--job-name``, ``--output`` (``logs_dir/slurm-%j.log``, or
  ``%A_%a`` for arrays), ``--time``, ``--cpus-per-task``, ``--mem``, ``--gres=gpu:N``,
  ``--partition``, ``--account``, ``--qos``, ``--array``, ``--chdir`` and the lineage
  labels as ``--comment`` (JSON). The environment reaches the job through sbatch's own
  environment and ``--export=ALL``, so secret values are never written to the script file.
  What the Slurm commands would read as options is taken out of that environment first (the
  caller's ``SBATCH_*``, which beat ``#SBATCH`` lines, an enclosing job's ``SLURM_*``,
  ``SRUN_*``...: :data:`SLURM_INPUT_PREFIXES`; ``SLURM_CONF`` and ``SLURM_CLUSTERS`` stay); a
  job's own variable of such a name (``-e``) reaches the job alone, the batch script giving it
  its name back.
- Status comes from ``scontrol show job -o`` while slurmctld remembers the job, then
  ``sacct`` where accounting works, then the jobcomp/filetxt log (``JobCompLoc``) where it
  does not; a job none of them knows is ``LOST``. sacct failing (slurmdbd down) is
  :class:`BackendUnavailable`, not "unknown". A pending job that Slurm says will never start
  (``DependencyNeverSatisfied``) is cancelled and FAILED with that reason. A log follower
  reads its file often but asks slurmctld whether the job ended at most every ``poll_interval``.
- Job arrays (``options={"array": "0-7%2"}``): the handle is the array job; its status
  has one entry per task in :attr:`JobStatus.tasks` (pending tasks Slurm still keeps in one
  compressed record, ``2,4-7%2``, are expanded) and aggregates them: RUNNING while any
  task has not ended, then FAILED naming the failed task ids if any failed, CANCELLED if
  any was cancelled, else SUCCEEDED. Logs are one file per task (``slurm-%A_%a.log``),
  merged with a ``[task]`` prefix, or one task's alone through :meth:`SlurmLauncher.task_handle`
  (job id ``ARRAY_TASK``, which Slurm's own tools accept too). Cancelling the array
  handle cancels every task, pending ones included.
- What an ended job used (``JobStatus.usage``: ``cpu_seconds``, ``max_rss_bytes``) is measured
  by the usage wrapper (``launchers/_usage.py``, the command's parent, reading ``wait4``) as on
  the Docker and Kubernetes backends: CPU seconds of the command and every process it waited
  for, and the largest resident set among them, exact, with or without slurmdbd. The launcher
  copies the wrapper next to the job logs (``.openlab-usage-<hash>.py``: a folder the nodes
  share, since they write the logs there) and the batch script runs the command under it with
  ``python3`` from the node's PATH (option ``python``): each task of a multi-task job with
  ``--no-forward``, since Slurm signals every process of a step itself; a one-task job exec'd
  as the batch shell's process (so is a job not measured), passing on what a ``--signal=B:...``
  warning or ``scancel --batch`` sends the batch shell alone (USR1, TERM, ...) and not the
  SIGTERM with which Slurm ends a job, which the command gets itself (``--slurm-batch``: that
  one follows a SIGCONT). It writes ``<log>.usage`` (``.usage.<rank>`` per
  task of a multi-task job, summed; one per array task, summed). ``measure_usage``: ``"auto"``
  (default) where the node has that Python (else the command runs as it is), ``true`` always,
  ``false`` never. Where the wrapper wrote nothing (a task killed with SIGKILL, ``false``) the
  numbers come from ``sacct`` where the cluster keeps accounting: TotalCPU of the job, the
  largest MaxRSS of its steps, which is what ``jobacct_gather`` sampled
  (``JobAcctGatherFrequency``), so a step shorter than one sample has none. ``sacct = false``
  never asks sacct (a cluster without accounting is found out once per launcher anyway).
- A job whose environment holds secret values (``-e MY_TOKEN=...``, an inherited
  ``WANDB_API_KEY``: :func:`orchestrator.secrets.secret_values`) never writes them into its log:
  slurmstepd writes the file, so the batch script runs the job under a filter, the local
  supervisor's ``--mask-output`` mode (``launchers/_supervise.py``), copied beside the logs
  (``.openlab-mask-<hash>.py``) and run with the usage wrapper's Python (option ``python``; a node
  without it runs the job unfiltered). It is the wrapper's parent (or the command's, unmeasured):
  exec'd as the batch shell's process for one task, so a ``--signal=B:...`` warning reaches it and
  it passes that on as the wrapper does, not Slurm's own end of the job, and it has written the
  job's last words before the job ends; under each task's shell for several tasks
  (``--no-forward``), inside srun's ``--label``. Its exit is the wrapper's. A job without secrets
  runs the same script as before (:meth:`SlurmLauncher._mask_lines`).
- ``scancel`` cancels; :meth:`SlurmLauncher.cancel` waits until the job has left the
  queue, so nothing of it is running when it returns.
- sbatch/scontrol errors are quoted verbatim; "Socket timed out" and "Unable to contact
  slurm controller" are retried a bounded number of times (``retries``, default 3). sbatch is
  run again after an error that leaves open whether it submitted the job (a socket timeout, no
  answer) only once squeue shows no job running that submission's script.

Config (``[backends.slurm]``): partition, account, qos, slurm_conf (exported as
SLURM_CONF), bin_dir, extra_args (list of sbatch flags), gpu_type (``--gres=gpu:TYPE:N``), retries,
log_dir, measure_usage, python, sacct (above).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import glob
import hashlib
import json
import math
import os
import pwd
import re
import shlex
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError, OpenlabError
from orchestrator.launchers.base import (
    TIME_LIMIT_REASON,
    BackendUnavailable,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    Launcher,
    LauncherError,
    combine_usage,
    first_failed_task,
    flag_option,
    helper_script,
    helpers_python,
    list_option,
    measure_usage_option,
    not_started,
    number_option,
    parse_duration,
    parse_memory,
    parse_usage,
    stopped_from_outside,
    task_ends_prefix,
    with_notes,
)

TRANSIENT = (
    "Socket timed out",
    "Unable to contact slurm controller",
    "Resource temporarily unavailable",
    "Zero Bytes were transmitted or received",
)

#: Transient errors after which a command may have done what it was asked: the request reached
#: slurmctld, whose answer was lost. sbatch is not simply run again after these (it would submit
#: the job twice): the queue is asked first whether the job is there (SlurmLauncher._sbatch).
MAYBE_DONE = ("Socket timed out", "Zero Bytes were transmitted or received")


class NoAnswer(BackendUnavailable):
    """A Slurm command that did not answer within its timeout (and was killed)."""


#: Slurm job states -> (JobState, reason when the state itself is the reason).
STATE_MAP: dict[str, tuple[JobState, str | None]] = {
    "PENDING": (JobState.PENDING, None),
    "CONFIGURING": (JobState.PENDING, None),
    "REQUEUED": (JobState.PENDING, None),
    "REQUEUE_HOLD": (JobState.PENDING, None),
    "REQUEUE_FED": (JobState.PENDING, None),  # requeued by its federation: it waits to run again
    "RESV_DEL_HOLD": (JobState.PENDING, None),  # held when its reservation was deleted: an admin releases it
    "RESIZING": (JobState.RUNNING, None),
    "RUNNING": (JobState.RUNNING, None),
    "COMPLETING": (JobState.RUNNING, None),
    "SUSPENDED": (JobState.RUNNING, None),
    "STOPPED": (JobState.RUNNING, None),
    "SIGNALING": (JobState.RUNNING, None),
    "STAGE_OUT": (JobState.RUNNING, None),
    "COMPLETED": (JobState.SUCCEEDED, None),
    "FAILED": (JobState.FAILED, None),
    "CANCELLED": (JobState.CANCELLED, "cancelled"),
    "TIMEOUT": (JobState.FAILED, TIME_LIMIT_REASON),
    "OUT_OF_MEMORY": (JobState.FAILED, "out of memory"),
    # A node that died or never booted under the job is the cluster's failure, not the job's: it
    # is run again from its checkpoint as after a preemption, not retried as a failure would be.
    "NODE_FAIL": (JobState.PREEMPTED, "a node of the job failed (NODE_FAIL)"),
    "BOOT_FAIL": (JobState.PREEMPTED, "a node of the job failed to boot (BOOT_FAIL)"),
    "DEADLINE": (JobState.FAILED, "deadline reached"),
    "PREEMPTED": (JobState.PREEMPTED, "preempted by a higher-priority job"),
    "SPECIAL_EXIT": (JobState.FAILED, "special exit"),
    "REVOKED": (JobState.CANCELLED, "revoked (federation)"),
}

#: Why a pending job waits, where Slurm documents that it will never start (squeue(1), JOB REASON
#: CODES): a dependency that "will never be satisfied" (``afterok:`` on a job that failed). Other
#: reasons that sound final are not, and stay pending with the reason in the status: a partition's
#: or QOS's *current* limits (PartitionTimeLimit, PartitionNodeLimit), a node not *currently*
#: available (ReqNodeNotAvail), an account or QOS an administrator can still add (InvalidAccount,
#: InvalidQOS), and BadConstraints, which sites see clear once the nodes are free.
NEVER_STARTS = frozenset({"DependencyNeverSatisfied"})


def never_started(reason: str) -> str:
    """The reason of a job that ended without starting because Slurm would never start it."""
    why = {"DependencyNeverSatisfied": "a job it depends on ended in a way its --dependency rules out"}
    return f"never started: Slurm says {reason} ({why.get(reason, 'it will never start')}); job cancelled"


_KV = re.compile(r"(\S+?)=(.*?)(?=\s+[A-Za-z][\w:/]*=|$)")


def parse_scontrol(line: str) -> dict[str, str]:
    """``scontrol show job -o`` output (one job per line) as a dict; values may contain spaces."""
    return {m.group(1): m.group(2) for m in _KV.finditer(line.strip())}


#: What the ``%`` patterns of ``--output`` are in the job's environment.
_PATTERN_VARS = {"%A": "$SLURM_ARRAY_JOB_ID", "%a": "$SLURM_ARRAY_TASK_ID", "%j": "$SLURM_JOB_ID"}


def shell_path(pattern: str) -> str:
    """A log-name pattern (``.../slurm-%j.usage``, ``slurm-%A_%a.usage``) as one bash word that the
    batch script expands to this job's own path."""
    parts = re.split(r"(%[Aaj])", pattern)
    return "".join(f'"{_PATTERN_VARS[p]}"' if p in _PATTERN_VARS else shlex.quote(p) for p in parts if p)


def directive(option: str, value: Any) -> str:
    """``#SBATCH --option=value``, ``value`` one word as sbatch reads a directive: it splits at blanks
    and ends the line at an unquoted ``#``, so a home such as ``/data/my runs`` made sbatch refuse
    every job (``Invalid directive found in batch script: runs/logs/slurm-%j.log``) and ``lab's``
    stopped it at an unmatched quote. Such a value goes in double quotes, a ``"`` or ``\\`` in it
    after a backslash (a backslash outside quotes does not keep a blank, in Slurm 22.05); a line
    break cannot be written at all, and is refused."""
    text = str(value)
    if "\n" in text or "\r" in text:
        raise LauncherError(f"--{option} {text!r}: a Slurm batch directive cannot hold a line break")
    if re.search(r"[\s'\"#\\]", text):
        text = '"' + re.sub(r'(["\\])', r"\\\1", text) + '"'
    return f"#SBATCH --{option}={text}"


def usage_prefix(log_path: str | Path) -> str:
    """Where a job's usage wrapper writes (each task's: ``.<rank>``): ``<log without .log>.usage``."""
    return str(log_path).removesuffix(".log") + ".usage"


def wrapper_path(log_dir: Path) -> Path:
    """The launcher's copy of the usage wrapper in the (shared) log folder, named by its content,
    so a job never runs a copy another openlab version left there."""
    digest = hashlib.sha256(helper_script("usage.py").read_bytes()).hexdigest()[:12]
    return log_dir / f".openlab-usage-{digest}.py"


#: The helper whose ``--mask-output`` mode masks a job's secrets in its output: the local supervisor.
MASK_HELPER = "supervise.py"


def mask_filter_path(log_dir: Path) -> Path:
    """The launcher's copy of the output filter (:data:`MASK_HELPER`) in the log folder, named by its
    content as :func:`wrapper_path` is."""
    digest = hashlib.sha256(helper_script(MASK_HELPER).read_bytes()).hexdigest()[:12]
    return log_dir / f".openlab-mask-{digest}.py"


def _user() -> str:
    """This process's login name, as squeue's ``-u`` takes it."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _account(uid: str) -> str:
    """``ada (uid 1000)`` for a uid as sacct gives it; the uid alone where this machine has no such account."""
    try:
        return f"{pwd.getpwuid(int(uid)).pw_name} (uid {uid})"
    except (KeyError, ValueError):
        return f"uid {uid}"


def slurm_time(seconds: int) -> str:
    """Seconds as Slurm's ``D-HH:MM:SS`` (Slurm rounds limits up to whole minutes)."""
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}" if days else f"{hours:02d}:{minutes:02d}:{secs:02d}"


def granted_tres(text: str | None) -> dict[str, int] | None:
    """What an allocation holds, from scontrol's ``TRES`` (allocated once the job started:
    ``cpu=2,mem=3G,node=1,billing=2,gres/gpu=1``): ``cpus``, ``memory_bytes``, ``nodes``, ``gpus``.
    None when there is nothing to read."""
    if not text or text in ("(null)", "None"):
        return None
    out: dict[str, int] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        try:
            if key == "cpu":
                out["cpus"] = int(value)
            elif key == "node":
                out["nodes"] = int(value)
            elif key == "gres/gpu":  # typed ones (gres/gpu:a100=2) are counted in it too
                out["gpus"] = int(value)
            elif key == "mem":
                out["memory_bytes"] = parse_memory(value)
        except (ValueError, OpenlabError):
            continue  # a form this Slurm prints that we do not read: the rest still counts
    return out or None


def _granted(row: Mapping[str, str]) -> dict[str, Any] | None:
    """What a started job was given, from scontrol's or sacct's record: its allocated TRES, and the
    partition, account and QOS it ran under (the cluster's defaults where the job named none, which
    nothing else records)."""
    granted: dict[str, Any] = dict(granted_tres(row.get("AllocTRES") or row.get("TRES")) or {})
    for key, field in (("partition", "Partition"), ("account", "Account"), ("qos", "QOS")):
        if (value := (row.get(field) or "").strip()) and value not in ("(null)", "None"):
            granted[key] = value
    return granted or None


def _parse_dt(text: str | None) -> dt.datetime | None:
    """Slurm prints local times without zone (``2026-12-02T18:46:49``); None for Unknown/None."""
    if not text or text in ("Unknown", "None", "N/A") or not text[:1].isdigit():
        return None
    try:
        return dt.datetime.fromisoformat(text).astimezone(dt.UTC)
    except ValueError:
        return None


def parse_sacct_bytes(text: str | None) -> int | None:
    """sacct's MaxRSS (``277080K``, ``1.5G``, ``0``) in bytes; None when empty."""
    try:
        return parse_memory(text) if text and text.strip() else None
    except OpenlabError:
        return None


def parse_sacct_duration(text: str | None) -> float | None:
    """sacct's TotalCPU (``00:01.731``, ``01:02:03``, ``2-01:02:03``) in seconds; None when empty."""
    whole, _, fraction = (text or "").strip().partition(".")  # parse_duration takes whole seconds
    if not whole:
        return None
    try:
        return parse_duration(whole) + float(f"0.{fraction or 0}")
    except (OpenlabError, ValueError):
        return None


def expand_hostlist(text: str | None) -> list[str]:
    """Every host a Slurm hostlist names: ``n[01-03,07],gpu1`` is n01, n02, n03, n07 and gpu1
    (zero padding kept; several bracket groups in one name are expanded in turn). A job on
    several nodes records its NodeList in this form, and "did it run on n02?" needs it whole."""
    items, depth, start = [], 0, 0
    text = text or ""
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    hosts: list[str] = []
    for item in (s.strip() for s in items):
        group = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
        if not group:
            hosts += [item] if item else []
            continue
        prefix, ranges, rest = group.groups()
        for part in ranges.split(","):
            low, dash, high = part.partition("-")
            numbers = range(int(low), int(high) + 1) if dash and low.isdigit() and high.isdigit() else None
            names = [f"{prefix}{n:0{len(low)}d}" for n in numbers] if numbers is not None else [prefix + part]
            for name in names:
                hosts += expand_hostlist(name + rest)
    return hosts


def expand_task_ids(text: str | None) -> list[str]:
    """Slurm's compressed array task list as task ids: ``"0-3"``, ``"2,4%1"``, ``"1-7:2"``, ``"[0-3]"``.

    Pending tasks stay in one record until they start (``ArrayTaskId=2,4-7%2`` in scontrol,
    ``123_[2,4-7%2]`` in sacct), so a status that did not expand them would miss tasks.
    Returns ``[]`` for anything it cannot read (a non-array job has no task list).
    """
    body = (text or "").strip().strip("[]").split("%", 1)[0]
    ids: list[str] = []
    try:
        for part in filter(None, body.split(",")):
            span, _, step = part.partition(":")
            if "-" in span:
                low, high = span.split("-", 1)
                ids.extend(str(i) for i in range(int(low), int(high) + 1, int(step or 1)))
            else:
                ids.append(str(int(span)))
    except ValueError:
        return []
    return ids


def _task_sort_key(task: str) -> tuple[int, str]:
    return (int(task), "") if task.isdigit() else (1 << 62, task)


def aggregate_tasks(tasks: dict[str, JobStatus]) -> JobStatus:
    """One status for a whole array, with ``tasks`` kept for per-task detail.

    Not finished while any task has not ended (a FAILED aggregate would make callers
    record the end and clean up while other tasks still run); once all have ended, any
    failed task makes the array FAILED with the failed ids in the reason and the first
    failed task's exit code, else any preempted task PREEMPTED (a task stopped by a stop signal
    counts: :func:`stopped_from_outside`), any cancelled task CANCELLED, any lost LOST, else
    SUCCEEDED.
    """
    ordered = {
        task: stopped_from_outside(status)
        for task, status in sorted(tasks.items(), key=lambda item: _task_sort_key(item[0]))
    }
    statuses = list(ordered.values())

    def named(state: JobState) -> list[str]:
        return [task for task, st in ordered.items() if st.state is state]

    failed, cancelled, lost = named(JobState.FAILED), named(JobState.CANCELLED), named(JobState.LOST)
    preempted = named(JobState.PREEMPTED)
    total = len(ordered)
    exit_code: int | None = None
    if any(not st.state.terminal for st in statuses):
        started = any(st.state is JobState.RUNNING or st.state.terminal for st in statuses)
        state = JobState.RUNNING if started else JobState.PENDING
        done = sum(1 for st in statuses if st.state.terminal)
        pending_reason = next((st.reason for st in statuses if st.reason), None)
        reason = f"{done} of {total} tasks ended" if started else pending_reason
        if failed:
            reason = f"{reason}; failed so far: task {', '.join(failed)}"
    elif failed:
        state = JobState.FAILED
        exit_code = ordered[failed[0]].exit_code
        detail = ", ".join(f"{task} ({ordered[task].reason or 'failed'})" for task in failed)
        reason = f"{len(failed)} of {total} tasks failed: task {detail}"
    elif preempted:
        state = JobState.PREEMPTED
        reason = f"{len(preempted)} of {total} tasks preempted: task {', '.join(preempted)}"
    elif cancelled:
        state, reason = JobState.CANCELLED, f"{len(cancelled)} of {total} tasks cancelled: task {', '.join(cancelled)}"
    elif lost:
        state, reason = JobState.LOST, f"{len(lost)} of {total} tasks lost: task {', '.join(lost)}"
    else:
        state, reason, exit_code = JobState.SUCCEEDED, None, 0
    hosts = sorted({st.host for st in statuses if st.host})
    starts = [st.started_at for st in statuses if st.started_at]
    ends = [st.ended_at for st in statuses if st.ended_at]
    return JobStatus(
        state=state,
        exit_code=exit_code,
        reason=reason,
        host=",".join(hosts) or None,
        started_at=min(starts) if starts else None,
        ended_at=max(ends) if ends and state.terminal else None,
        tasks=ordered,
    )


def _exit_code(text: str | None) -> tuple[int | None, int]:
    """``"3:0"`` -> (3, 0): exit code and terminating signal."""
    if not text or ":" not in text:
        return None, 0
    code, sig = text.split(":", 1)
    try:
        return int(code), int(sig)
    except ValueError:
        return None, 0


EXTRA_ARGS_EXAMPLE = '["--exclusive"]'

#: sbatch flags ``extra_args`` may not give, each with what to give instead: openlab writes them
#: itself, reads the job's log, environment and labels through them, or records them from their
#: own field (a ``--partition`` in extra_args beat the recorded one, so lineage named the wrong one).
OWN_FLAGS: dict[str, str] = {
    "--output": "openlab reads the job's log from its own --output (log_dir)",
    "--error": "openlab reads the job's log from its own --output (log_dir)",
    "--export": "the job's environment is passed with --export=ALL (job run -e KEY=VALUE)",
    "--job-name": "the job's name is openlab's (job run --name)",
    "--comment": "openlab's labels are the job's --comment",
    "--parsable": "openlab adds it",
    "--open-mode": "openlab appends to the job's log, so a requeued job keeps its earlier run's",
    "--chdir": "give the working directory (job run --workdir)",
    "--array": "use the array option",
    "--time": "give the time limit (job run --time-limit, resources.<stage>.time_limit)",
    "--cpus-per-task": "give cpus",
    "--mem": "give memory",
    "--nodes": "give nodes",
    "--ntasks-per-node": "give tasks_per_node",
    "--partition": "use the partition option",
    "--account": "use the account option",
    "--qos": "use the qos option",
    "--nodelist": "use the nodelist option",
    "--constraint": "use the constraint option",
}
#: ``extra_args`` flags that ask what a job's own fields also ask (field, what openlab writes for it):
#: given beside that field, the job asked twice (``--gres=gpu:1`` and ``--gres=gpu:a100:2``: it got
#: the second, lineage asked the first) or sbatch refused it after the attempt was recorded
#: (``--mem`` with ``--mem-per-cpu``: "mutually exclusive"). Alone they stay the user's to give.
_DOUBLED = {
    "--gres=gpu": ("gpus", "--gres=gpu:N; for a type set the gpu_type option (--gres=gpu:TYPE:N)"),
    "--gpus": ("gpus", "--gres=gpu:N; for a type set the gpu_type option (--gres=gpu:TYPE:N)"),
    "--gpus-per-node": ("gpus", "--gres=gpu:N; for a type set the gpu_type option (--gres=gpu:TYPE:N)"),
    "--gpus-per-task": ("gpus", "--gres=gpu:N; for a type set the gpu_type option (--gres=gpu:TYPE:N)"),
    "--mem-per-cpu": ("memory", "--mem, which sbatch refuses beside it"),
    "--mem-per-gpu": ("memory", "--mem, which sbatch refuses beside it"),
    "--signal": ("warn_before_limit", "--signal=B:USR1@N"),
}
_DOUBLED_SHORT = {"-G": "--gpus"}
_GPU_GRES = re.compile(r"(^|,)gpu(:|$|,)")


def refuse_doubled(spec: JobSpec, flags: Sequence[str]) -> None:
    """Refuse an ``extra_args`` flag that asks again what ``spec`` asks by its own field (:data:`_DOUBLED`)."""
    for flag in flags:
        text = str(flag).strip()
        if not text:
            continue
        word, _, value = text.partition("=") if "=" in text.split(None, 1)[0] else text.partition(" ")
        name = _DOUBLED_SHORT.get(word[:2], word) if not word.startswith("--") else word
        if name == "--gres":
            name = "--gres=gpu" if _GPU_GRES.search(value.strip()) else name
        if name not in _DOUBLED:
            continue
        field, written = _DOUBLED[name]
        if getattr(spec, field):
            raise ConfigError(
                f"extra_args {flag!r} asks again what the job's {field} ({getattr(spec, field)}) asks: openlab "
                f"writes {written}; give one of them"
            )


_SHORT_FLAGS = {
    "-o": "--output", "-e": "--error", "-J": "--job-name", "-D": "--chdir", "-a": "--array", "-t": "--time",
    "-c": "--cpus-per-task", "-N": "--nodes", "-p": "--partition", "-A": "--account", "-q": "--qos",
    "-w": "--nodelist", "-C": "--constraint",
}  # fmt: skip


def refuse_own_flags(flags: Sequence[str]) -> None:
    """Refuse an ``extra_args`` flag that is openlab's own (:data:`OWN_FLAGS`): ``--export=NONE``
    ran the job without its -e values, ``--output`` sent its log where openlab does not read it."""
    for flag in flags:
        if "\n" in str(flag) or "\r" in str(flag):  # the rest of the line would be a directive of its own
            raise ConfigError(f"extra_args {flag!r}: a Slurm batch directive cannot hold a line break")
        if not str(flag).strip():  # an empty `#SBATCH` line
            raise ConfigError(f"extra_args {flag!r}: an empty flag; remove it")
        word = str(flag).strip().split("=", 1)[0].split(None, 1)[0] if str(flag).strip() else ""
        name = _SHORT_FLAGS.get(word[:2], word) if word.startswith("-") and not word.startswith("--") else word
        if name.startswith("--") and len(name) > 3 and name not in OWN_FLAGS:
            # sbatch takes a long option by any prefix that names it alone (getopt_long): `--part=batch`
            # is --partition, and passed here the job ran in a partition lineage did not name
            name = next((own for own in OWN_FLAGS if own.startswith(name)), name)
        if name in OWN_FLAGS:
            raise ConfigError(f"extra_args {flag!r}: {name} is not for extra_args: {OWN_FLAGS[name]}")


#: Prefixes of the environment variables the Slurm commands read as input: sbatch's ``SBATCH_*``
#: (which beat the script's ``#SBATCH`` lines), salloc's and srun's (srun runs in the job, with
#: the job's environment), squeue's, sacct's, scancel's (``SQUEUE_PARTITION``, ``SCANCEL_STATE``
#: narrow what the launcher asks for) and ``SLURM_*``: what an enclosing job sets
#: (``SLURM_MEM_PER_CPU``, ``SLURM_NTASKS``...), which srun and sbatch read as options, and
#: ``SLURM_TIME_FORMAT``, which changes the times the launcher parses.
SLURM_INPUT_PREFIXES = ("SBATCH_", "SALLOC_", "SRUN_", "SLURM_", "SQUEUE_", "SACCT_", "SCANCEL_", "SINFO_", "SCONTROL_")
#: ...but for these: where the cluster's slurm.conf is, and which clusters every command talks to.
SLURM_INPUT_KEPT = frozenset({"SLURM_CONF", "SLURM_CLUSTERS"})
#: A job's own variable of such a name (``-e SLURM_HINT=...``) reaches sbatch under this prefix
#: and is given its name back by the batch script, for the job alone.
PASSED_PREFIX = "OPENLAB_JOB_ENV__"


def slurm_input(name: str) -> bool:
    """Whether a Slurm command would read the environment variable ``name`` as an option."""
    return name.startswith(SLURM_INPUT_PREFIXES) and name not in SLURM_INPUT_KEPT


def passed_env(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """A job's environment as sbatch is given it, and the names the batch script gives back.

    A job's variable that sbatch would read as an option (:func:`slurm_input`) goes under
    :data:`PASSED_PREFIX`, so it reaches the job (``--export=ALL``) without changing what sbatch
    asks Slurm for; names that are not shell identifiers cannot be options, and go as they are."""
    given: dict[str, str] = {}
    renamed: list[str] = []
    for key, value in env.items():
        name = str(key)
        if slurm_input(name) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            given[PASSED_PREFIX + name] = str(value)
            renamed.append(name)
        else:
            given[name] = str(value)
    return given, sorted(renamed)


#: What the Slurm client says when it finds no slurm.conf (nor a DNS SRV record naming the controller).
NO_CONFIG = "Could not establish a configuration source"


def _no_config(tool: str) -> str:
    return (
        f"the Slurm client found no configuration ({tool}: {NO_CONFIG}): set SLURM_CONF to the cluster's "
        "slurm.conf, or slurm_conf under [backends.slurm] in openlab.toml"
    )


class SlurmLauncher(Launcher):
    """Runs jobs with sbatch (see the module docstring)."""

    name = "slurm"
    poll_interval = 0.5
    multi_task = True
    max_nodes = None
    known_options = Launcher.known_options | {
        "partition", "account", "qos", "constraint", "nodelist", "array", "extra_args", "log_dir", "gpu_type",
        "slurm_conf", "bin_dir", "retries", "cancel_timeout", "measure_usage", "sacct",
        "jobcomp_loc",  # where jobcomp/filetxt writes: read from `scontrol show config` unless set
    }  # fmt: skip
    settings_only = Launcher.settings_only | {
        "slurm_conf", "bin_dir", "retries", "cancel_timeout", "sacct", "jobcomp_loc",
    }  # fmt: skip

    def refuse_unsupported(self, spec: JobSpec) -> None:
        super().refuse_unsupported(spec)
        refuse_doubled(spec, list_option({**self.config, **spec.options}, "extra_args", EXTRA_ARGS_EXAMPLE))

    @classmethod
    def check_options(cls, opts: Mapping[str, Any]) -> None:
        super().check_options(opts)
        refuse_own_flags(list_option(opts, "extra_args", EXTRA_ARGS_EXAMPLE))
        gpu_type = opts.get("gpu_type")
        if gpu_type is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", str(gpu_type)):
            raise ConfigError(f"gpu_type {gpu_type!r}: one GPU type as gres.conf names it, e.g. a100 or h100")
        number_option(opts, "retries", 3)
        number_option(opts, "cancel_timeout", 30)
        measure_usage_option(opts)
        flag_option(opts, "sacct", True)

    def __init__(self, settings: Any = None, config: Any = None) -> None:
        super().__init__(settings, config)
        self.script_dir = self.settings.home / "jobs" / "slurm"
        self.retries = int(number_option(self.config, "retries", 3))
        #: job id -> (when, whether it had ended) of the last look at it: a log follower asks
        #: whether its job ended from this, asking slurmctld at most every poll_interval (see _ended)
        self._looked: dict[str, tuple[float, bool]] = {}

    # -- running the Slurm CLI --------------------------------------------------------
    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment without the variables the Slurm commands read as input
        (:func:`slurm_input`): ``SBATCH_PARTITION`` in the caller's shell beat the job's own
        ``#SBATCH --partition``, and the ``SLURM_*`` of an enclosing job (an orchestrator run
        inside an sbatch job) reached the new job through ``--export=ALL``, where srun refused to
        start (``SLURM_MEM_PER_CPU, SLURM_MEM_PER_GPU, and SLURM_MEM_PER_NODE are mutually exclusive``)."""
        env = {key: value for key, value in os.environ.items() if not slurm_input(key)}
        if self.config.get("slurm_conf"):
            env["SLURM_CONF"] = str(self.config["slurm_conf"])
        if extra:
            env.update(extra)
        return env

    def _bin(self, tool: str) -> str:
        bin_dir = self.config.get("bin_dir")
        return str(Path(bin_dir) / tool) if bin_dir else tool

    def _run(
        self,
        tool: str,
        *args: str,
        env: dict[str, str] | None = None,
        check: bool = True,
        timeout: float = 30,
        retries: int | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command, retrying transient controller errors (``retries`` times, else the
        launcher's); quote its error verbatim."""
        argv = [self._bin(tool), *args]
        retries = self.retries if retries is None else retries
        conf = (env or self._env()).get("SLURM_CONF")
        if conf and not Path(conf).is_file():  # the client would retry for a minute, then fail
            raise BackendUnavailable(
                f"SLURM_CONF is {conf}, which does not exist: point it (or slurm_conf under [backends.slurm]) "
                "at the cluster's slurm.conf"
            )
        delay = 0.5
        for attempt in range(retries + 1):
            try:
                proc = subprocess.run(
                    argv, capture_output=True, text=True, env=env or self._env(), timeout=timeout, check=False
                )
            except FileNotFoundError:
                raise BackendUnavailable(f"{tool} not found: is the Slurm client installed (bin_dir)?") from None
            except subprocess.TimeoutExpired:
                if attempt < retries:
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise NoAnswer(f"{tool} did not answer within {timeout:g}s") from None
            message = "; ".join(line.strip() for line in (proc.stderr or proc.stdout).strip().splitlines())
            if proc.returncode != 0 and any(t in message for t in TRANSIENT) and attempt < retries:
                time.sleep(delay)
                delay *= 2
                continue
            if proc.returncode != 0 and NO_CONFIG in message:  # whoever asked: nothing here can reach Slurm
                raise BackendUnavailable(_no_config(tool))
            if check and proc.returncode != 0:
                if any(t in message for t in TRANSIENT):
                    raise BackendUnavailable(f"{tool} failed after {retries + 1} tries: {message}")
                raise LauncherError(f"{tool} failed: {message}")
            return proc
        raise AssertionError("unreachable")

    # -- submit ------------------------------------------------------------------------
    def batch_script(self, spec: JobSpec, log_pattern: str) -> str:
        """The generated batch script (public so users and tests can see exactly what is sent)."""
        opts = {**self.config, **spec.options}
        lines = ["#!/bin/bash", directive("job-name", spec.name), directive("output", log_pattern)]
        # a requeued job (preemption, a node failure) starts its script again: by default Slurm then
        # empties its output, and the run before the requeue (how far it got, why it stopped) was lost
        lines.append("#SBATCH --open-mode=append")
        lines.append("#SBATCH --export=ALL")
        if spec.time_limit:
            lines.append(f"#SBATCH --time={slurm_time(spec.time_limit)}")
        if spec.warn_before_limit:  # to the batch shell, which passes it on to the task (see _usage_lines)
            lines.append(f"#SBATCH --signal=B:USR1@{spec.warn_before_limit}")
        if spec.cpus:
            lines.append(f"#SBATCH --cpus-per-task={max(1, math.ceil(spec.cpus))}")
        if spec.memory_bytes:
            lines.append(f"#SBATCH --mem={max(1, math.ceil(spec.memory_bytes / 2**20))}M")
        if spec.gpus:  # of one type where gpu_type names it (gres.conf's Type): --gres=gpu:a100:2
            typed = f"{opts['gpu_type']}:" if opts.get("gpu_type") else ""
            lines.append(f"#SBATCH --gres=gpu:{typed}{spec.gpus}")
        if spec.tasks > 1:
            lines.append(f"#SBATCH --nodes={spec.nodes}")
            lines.append(f"#SBATCH --ntasks-per-node={spec.tasks_per_node}")
        for key in ("partition", "account", "qos", "array", "nodelist", "constraint"):
            if opts.get(key):
                lines.append(directive(key, opts[key]))
        if spec.workdir:
            lines.append(directive("chdir", spec.workdir))
        for flag in list_option(opts, "extra_args", EXTRA_ARGS_EXAMPLE):
            lines.append(f"#SBATCH {flag}")
        lines.append("")
        lines.append(
            '[ "${SLURM_RESTART_COUNT:-0}" = 0 ] || echo "[openlab] Slurm requeued the job and started it again'
            ' (restart $SLURM_RESTART_COUNT); the log of its earlier run is above"'
        )
        if spec.workdir:  # Slurm runs a job whose --chdir it cannot enter in /tmp, with one line in the log
            where = shlex.quote(spec.workdir)
            lines.append(
                f'[ "$PWD" -ef {where} ] || {{ echo "error: the job cannot enter its working directory "{where}'
                " >&2; exit 127; }"
            )
        for name in passed_env(spec.env)[1]:  # the job's own SBATCH_*/SLURM_*: see passed_env
            lines.append(f'export {name}="${PASSED_PREFIX}{name}"; unset {PASSED_PREFIX}{name}')
        measured = self._usage_lines(opts, log_pattern)
        lines.extend(measured)
        masked = self._mask_lines(spec, opts, log_pattern)
        lines.extend(masked)
        # under the output filter where there is one (_mask_lines): "$@" is its command line, else empty
        under = '"$@" ' if masked else ""
        if spec.tasks > 1:
            lines.extend(self._task_lines(spec, log_pattern, masked=bool(masked)))
        elif measured:  # exec: see _usage_lines
            command = " ".join(shlex.quote(c) for c in spec.command)
            lines.append(
                f'if [ -n "$OPENLAB_USAGE_PY" ]; then exec {under}"$OPENLAB_USAGE_PY" -I -S "$OPENLAB_USAGE_WRAPPER" '
                f'--slurm-batch "$OPENLAB_USAGE" -- {command}; else exec {under}{command}; fi'
            )
        else:
            lines.append(f"exec {under}" + " ".join(shlex.quote(c) for c in spec.command))
        return "\n".join(lines) + "\n"

    @staticmethod
    def _mask_lines(spec: JobSpec, opts: Mapping[str, Any], log_pattern: str) -> list[str]:
        """Where the job's environment holds secret values (:func:`orchestrator.secrets.secret_values`:
        its own, ``-e MY_TOKEN=...``, and the ones it inherits, ``--export=ALL``), set up the filter its
        output goes through on the way to its log (the local supervisor's ``--mask-output`` mode, from
        the launcher's copy beside the logs, :func:`mask_filter_path`, run with the usage wrapper's
        Python where the node has it), and leave its command line in ``"$@"`` for a one-task job
        (empty without that Python: the job then runs as it is). No lines for a job without secrets.

        The filter is the parent of the usage wrapper, or of the command, and reads their output
        through a pipe, so the job's exit status, its signals and its usage record are the wrapper's
        as before (``_supervise.py`` says how). For a one-task job it is the batch shell's process
        (exec'd), so it outlives the end of the command and has written everything before the job
        ends (a process the batch shell left behind is killed by Slurm, mid-write); for a task of a
        multi-task job it is the task's process, the per-task shell waiting for it."""
        if not spec.secret_values():
            return []
        lines = [
            f"OPENLAB_MASK_FILTER={shlex.quote(str(mask_filter_path(Path(log_pattern).parent)))}",
            f"OPENLAB_MASK_PY={shlex.quote(helpers_python(opts))}",
            '[ -r "$OPENLAB_MASK_FILTER" ] && command -v "$OPENLAB_MASK_PY" >/dev/null 2>&1 || OPENLAB_MASK_PY=',
            "export OPENLAB_MASK_FILTER OPENLAB_MASK_PY",
        ]
        if spec.tasks == 1:  # the batch shell's own process: passes on a signal for it alone (_supervise.py)
            lines += [
                "set --",
                '[ -z "$OPENLAB_MASK_PY" ] || set -- "$OPENLAB_MASK_PY" -I -S "$OPENLAB_MASK_FILTER" --mask-output '
                "--slurm-batch --",
            ]
        return lines

    @staticmethod
    def _usage_lines(opts: Mapping[str, Any], log_pattern: str) -> list[str]:
        """Set up the usage wrapper (module docstring): where it writes, with which Python ("" when
        ``measure_usage = "auto"`` and the node has no such Python, or no copy of the wrapper: the
        command then runs as it is). No lines for ``measure_usage = false``.

        A job of one task is exec'd (under the wrapper, or alone), so it is the batch shell's process:
        a signal for the batch shell alone (``--signal=B:USR1@300``, ``scancel --batch``) reaches
        it, where bash, with no trap, died of it (exit by signal 10: the job FAILED, and the warning
        never reached the training, which Slurm then killed with the step)."""
        mode = measure_usage_option(opts)
        if mode is False:
            return []
        python = helpers_python(opts)
        lines = [
            f"OPENLAB_USAGE={shell_path(usage_prefix(log_pattern))}",
            f"OPENLAB_USAGE_WRAPPER={shlex.quote(str(wrapper_path(Path(log_pattern).parent)))}",
            f"OPENLAB_USAGE_PY={shlex.quote(python)}",
        ]
        if mode is None:
            lines.append(
                '[ -r "$OPENLAB_USAGE_WRAPPER" ] && command -v "$OPENLAB_USAGE_PY" >/dev/null 2>&1 || OPENLAB_USAGE_PY='
            )
        lines += [
            'rm -f "$OPENLAB_USAGE" "$OPENLAB_USAGE".*  # a requeued job starts afresh',
            "export OPENLAB_USAGE OPENLAB_USAGE_WRAPPER OPENLAB_USAGE_PY",
        ]
        return lines

    def _task_lines(self, spec: JobSpec, log_pattern: str, *, masked: bool = False) -> list[str]:
        """Start one process per task with ``srun``, each told its place; end with the exit code of
        the task that failed first.

        The rendezvous is the first node of the allocation (where this script runs) on a port
        taken from the job id, so two jobs sharing a node do not collide. ``--kill-on-bad-exit``
        ends every task when one fails (a hung collective would otherwise hold the nodes until
        the time limit); srun then exits with the *highest* code, which is the 143 of the tasks it
        stopped, not the failure. So each task's wrapper writes how it ended (rank, code, node,
        time) to ``<log>.ends.<rank>`` and the job exits with the code of the first task that
        failed: a crash is FAILED with its own code, and a preemption (every task SIGTERMed)
        stays a preemption. ``--label`` puts the rank in front of each log line. With ``masked``
        (:meth:`_mask_lines`) each task runs under the output filter, ``--no-forward`` as the wrapper.
        """
        cpus = f" --cpus-per-task={max(1, math.ceil(spec.cpus))}" if spec.cpus else ""  # srun no longer inherits it
        ends = shell_path(task_ends_prefix(log_pattern))
        # each task under the usage wrapper, when the batch script set one up (see _usage_lines)
        run_task = (
            'if [ -n "${OPENLAB_USAGE_PY:-}" ]; then "$OPENLAB_USAGE_PY" -I -S "$OPENLAB_USAGE_WRAPPER" --no-forward '
            '"$OPENLAB_USAGE.$RANK" -- "$@"; else "$@"; fi\n'
        )
        if masked:  # ...and that under the output filter, where the batch script set one up (see _mask_lines)
            run_task = (
                'if [ -n "${OPENLAB_USAGE_PY:-}" ]; then set -- "$OPENLAB_USAGE_PY" -I -S "$OPENLAB_USAGE_WRAPPER" '
                '--no-forward "$OPENLAB_USAGE.$RANK" -- "$@"; fi\n'
                'if [ -n "${OPENLAB_MASK_PY:-}" ]; then set -- "$OPENLAB_MASK_PY" -I -S "$OPENLAB_MASK_FILTER" '
                '--mask-output --no-forward -- "$@"; fi\n"$@"\n'
            )
        place = (
            'export RANK="$SLURM_PROCID" LOCAL_RANK="$SLURM_LOCALID" NODE_RANK="$SLURM_NODEID" '
            f"LOCAL_WORLD_SIZE={spec.tasks_per_node}\n"
            # Slurm signals every process of the step, the task and this script: the script only has to
            # outlive the signal to record the task's end (passing it on would deliver it twice). The task
            # runs in the foreground, with every signal's default: bash starts a background command with
            # SIGINT and SIGQUIT ignored, so `scancel -s INT` did not reach it.
            "trap : TERM INT QUIT HUP USR1 USR2\n"
            f"{run_task}code=$?\n"
            'echo "$RANK $code ${SLURMD_NODENAME:-$(hostname)} $(date +%s.%N)" > "$OPENLAB_TASK_ENDS.$RANK"\n'
            "exit $code"
        )
        scontrol = shlex.quote(self._bin("scontrol"))
        return [
            f'MASTER_ADDR="$({scontrol} show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            'MASTER_PORT="$((20000 + SLURM_JOB_ID % 20000))"',
            f"OPENLAB_TASK_ENDS={ends}",
            f"export MASTER_ADDR MASTER_PORT OPENLAB_TASK_ENDS WORLD_SIZE={spec.tasks}",
            'rm -f "$OPENLAB_TASK_ENDS".*  # a requeued job starts afresh',
            f"{shlex.quote(self._bin('srun'))} --kill-on-bad-exit=1 --label{cpus} "
            f"bash -c {shlex.quote(place)} openlab-task " + " ".join(shlex.quote(c) for c in spec.command) + " &",
            # A signal for this script alone (`--signal=B:USR1@300`, `scancel --batch`) goes on to srun,
            # which passes it to every task: the warning before the time limit reaches the training.
            "srun_pid=$!",
            "trap 'kill -s TERM $srun_pid 2>/dev/null' TERM",
            "trap 'kill -s USR1 $srun_pid 2>/dev/null' USR1",
            "while :; do wait $srun_pid; code=$?; kill -0 $srun_pid 2>/dev/null || break; done",
            "first=$(cat \"$OPENLAB_TASK_ENDS\".* 2>/dev/null | sort -n -k4 | awk '$2 != 0 {print; exit}')",
            'if [ -n "$first" ]; then',
            "    set -- $first",
            # 143/137 first: every task was stopped from outside (a cancel, a preemption), none failed
            '    case "$2" in 143|137) ;; *) echo "openlab: task $1 on $3 failed first (exit $2); srun stopped the'
            ' other tasks" >&2 ;; esac',
            '    exit "$2"',
            "fi",
            "exit $code",
        ]

    def submit(self, spec: JobSpec) -> JobHandle:
        opts = {**self.config, **spec.options}
        log_dir = Path(opts.get("log_dir") or self.settings.logs_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        is_array = bool(opts.get("array"))
        log_pattern = str(log_dir / ("slurm-%A_%a.log" if is_array else "slurm-%j.log"))
        if "\\" in log_pattern:  # Slurm: "\\ in --output: do not process any of the replacement symbols"
            raise LauncherError(
                f"the Slurm log folder {log_dir} has a backslash, which sbatch's --output takes to mean "
                "'no %j in this name' (one log for every job): set log_dir in [backends.slurm] (or "
                "OPENLAB_HOME) to a folder without one"
            )
        script = self.batch_script(spec, log_pattern)
        if measure_usage_option(opts) is not False:
            self._install_helper(wrapper_path(log_dir), "usage.py")
        if "OPENLAB_MASK_FILTER=" in script:
            self._install_helper(mask_filter_path(log_dir), MASK_HELPER)
        self.script_dir.mkdir(parents=True, exist_ok=True)
        script_path = self.script_dir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', spec.name)[:40]}-{uuid.uuid4().hex[:8]}.sh"
        # the owner's alone: a job's command may carry a secret (`--db-password X`), masked in lineage but
        # needed by the job as it is, and the jobs folder may be on a filesystem the whole cluster reads
        fd = os.open(script_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(script)
        env_extra = passed_env(spec.env)[0]
        env_extra["OPENLAB_JOB_NAME"] = spec.name
        env_extra["OPENLAB_LABELS"] = json.dumps(dict(spec.labels), sort_keys=True)
        if spec.artifact_root is not None:
            Path(spec.artifact_root).mkdir(parents=True, exist_ok=True)
            env_extra["OPENLAB_ARTIFACT_ROOT"] = str(spec.artifact_root)
        args = ["--parsable"]
        if spec.labels:  # on the command line, not in the script: no quoting rules to trip over
            args.append("--comment=" + json.dumps(dict(spec.labels), sort_keys=True, separators=(",", ":")))
        proc = self._sbatch([*args, str(script_path)], script_path, spec.name, self._env(env_extra))
        if proc.returncode != 0:
            message = "; ".join(line.strip() for line in (proc.stderr or proc.stdout).strip().splitlines())
            raise LauncherError(f"sbatch refused the job: {message}")
        job_id = proc.stdout.strip().split(";", 1)[0]
        if not job_id.isdigit():
            raise LauncherError(f"sbatch --parsable printed no job id: {proc.stdout.strip()!r}")
        log_path = log_pattern.replace("%A", job_id).replace("%j", job_id)
        extra: dict[str, Any] = {"script": str(script_path), "array": is_array}
        if is_array:  # every task it has, for a look after slurmctld forgot some (_with_forgotten_tasks)
            extra["array_tasks"] = str(opts["array"])
        return JobHandle(self.name, job_id, log_path, extra)

    def _sbatch(
        self, args: list[str], script_path: Path, name: str, env: dict[str, str]
    ) -> subprocess.CompletedProcess[str]:
        """Run sbatch, retrying transient errors (``retries``) without submitting the job twice.

        After an error that leaves open whether the job went in (:data:`MAYBE_DONE`, or no answer
        at all) the queue is asked for a job running this submission's own script (a new file each
        time) before sbatch runs again: found, its id is the answer; while the queue cannot say,
        sbatch is not run blind. A refusal (the controller said no) is returned as it is.
        """
        delay, message, unsure = 0.5, "", False
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(delay)
                delay *= 2
            if unsure:
                found = self._submitted(script_path, name)
                if found:
                    return subprocess.CompletedProcess(["sbatch", *args], 0, stdout=f"{found}\n", stderr="")
                if found is None:  # the queue did not answer: the job may be in it
                    continue
            try:
                proc = self._run("sbatch", *args, env=env, check=False, retries=0)
            except NoAnswer as exc:
                message, unsure = str(exc), True
                continue
            message = "; ".join(line.strip() for line in (proc.stderr or proc.stdout).strip().splitlines())
            if proc.returncode == 0 or not any(t in message for t in TRANSIENT):
                return proc
            unsure = any(t in message for t in MAYBE_DONE)
        if unsure and (found := self._submitted(script_path, name)):
            return subprocess.CompletedProcess(["sbatch", *args], 0, stdout=f"{found}\n", stderr="")
        maybe = (
            f"; it may have submitted the job all the same: look for one running {script_path} (squeue -o %o)"
            if unsure
            else ""
        )
        raise BackendUnavailable(f"sbatch failed after {self.retries + 1} tries: {message}{maybe}")

    def _submitted(self, script_path: Path, name: str) -> str | None:
        """The id of a job of this user's that runs ``script_path`` (each submission's own file);
        ``""`` when the queue has none, None when squeue did not answer."""
        args = ["-h", "--states=all", "-u", _user(), "-o", "%i|%o"]
        if "," not in name:  # --name takes a list
            args.append(f"--name={name}")
        try:
            proc = self._run("squeue", *args, check=False, retries=0)
        except BackendUnavailable:
            return None
        if proc.returncode != 0:
            return None
        wanted = {str(script_path), str(script_path.absolute())}
        for line in proc.stdout.splitlines():
            job_id, _, command = line.strip().partition("|")
            if command in wanted and job_id.partition("_")[0].isdigit():
                return job_id.partition("_")[0]  # an array's tasks: the array job
        return ""

    def find(self, labels: Mapping[str, str]) -> list[JobHandle]:
        """This user's jobs in the queue (running, pending, or ended within the cluster's MinJobAge)
        whose ``--comment`` holds ``labels``; an array is found once, as its array job."""
        wanted = {str(k): str(v) for k, v in labels.items()}
        proc = self._run("squeue", "-h", "--states=all", "-u", _user(), "-o", "%i|%k", check=False)
        if proc.returncode != 0:
            message = "; ".join(line.strip() for line in (proc.stderr or proc.stdout).strip().splitlines())
            raise BackendUnavailable(f"squeue could not list this user's jobs: {message}")
        found: dict[str, JobHandle] = {}
        for line in proc.stdout.splitlines():
            job_id, _, comment = line.strip().partition("|")
            job_id = job_id.partition("_")[0]
            try:
                have = json.loads(comment)
            except ValueError:  # (null), or a comment someone else wrote
                continue
            if not job_id.isdigit() or job_id in found or not isinstance(have, dict):
                continue
            if all(str(have.get(k)) == v for k, v in wanted.items()):
                rows = self._scontrol(job_id) or [{}]
                found[job_id] = JobHandle(self.name, job_id, rows[0].get("StdOut") or None)
        return list(found.values())

    @staticmethod
    def _install_helper(path: Path, name: str) -> None:
        """Put the launcher's copy of helper ``name`` (the usage wrapper, the output filter) at
        ``path`` (whole or not at all: a job starting meanwhile must not run half a file)."""
        text = helper_script(name).read_bytes()
        if path.exists() and path.read_bytes() == text:
            return
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_bytes(text)
        tmp.chmod(0o644)
        tmp.replace(path)

    # -- status ------------------------------------------------------------------------
    def _scontrol(self, job_id: str) -> list[dict[str, str]] | None:
        proc = self._run("scontrol", "show", "job", "-o", job_id, check=False)
        if proc.returncode != 0:
            message = (proc.stderr or proc.stdout).strip()
            if "Invalid job id" in message:
                return None
            if any(t in message for t in TRANSIENT):  # slurmctld down or failing over: the job is not the problem
                raise BackendUnavailable(f"scontrol show job {job_id} failed: {message}")
            raise LauncherError(f"scontrol show job {job_id} failed: {message}")
        return [parse_scontrol(line) for line in proc.stdout.splitlines() if line.strip()]

    def _sacct(self, job_id: str) -> list[dict[str, str]] | None:
        """sacct's records of ``job_id``; None where it has none, or the cluster keeps no accounting
        (``sacct = false``, or sacct says so). Any other failure is :class:`BackendUnavailable`:
        slurmdbd down or slow is not "no such job", which recorded a job that had ended as LOST,
        for good, whenever slurmdbd did not answer after slurmctld had forgotten the job."""
        if not flag_option(self.config, "sacct", True):
            return None
        fields = ["JobID", "State", "ExitCode", "NodeList", "Start", "End", "Reason", "AllocTRES", "Partition"]
        fields += ["Account", "QOS"]
        proc = self._run("sacct", "-j", job_id, "-X", "-n", "-P", "-o", ",".join(fields), check=False)
        if proc.returncode != 0:
            message = "; ".join(line.strip() for line in (proc.stderr or proc.stdout).strip().splitlines())
            if "accounting storage is disabled" in message.lower():
                self.config["sacct"] = False
                return None
            raise BackendUnavailable(
                f"slurmctld no longer knows job {job_id} and sacct failed: {message or f'exit {proc.returncode}'}"
            )
        if not proc.stdout.strip():
            return None
        rows = []
        for line in proc.stdout.splitlines():
            values = dict(zip(fields, line.split("|"), strict=False))
            array_job, sep, task = values.get("JobID", "").partition("_")  # 123_4, or 123_[5-7%2] still pending
            rows.append(
                {
                    **({"ArrayJobId": array_job, "ArrayTaskId": task} if sep else {}),
                    # "CANCELLED by 1000": who cancelled it (an admin, the user, openlab) is the reason's
                    "JobState": values.get("State", "").split(" ")[0],
                    "CancelledBy": values.get("State", "").partition(" by ")[2].strip(),
                    "ExitCode": values.get("ExitCode", ""),
                    "NodeList": values.get("NodeList", ""),
                    "StartTime": values.get("Start", ""),
                    "EndTime": values.get("End", ""),
                    "Reason": values.get("Reason", ""),
                    "AllocTRES": values.get("AllocTRES", ""),
                    "Partition": values.get("Partition", ""),
                    "Account": values.get("Account", ""),
                    "QOS": values.get("QOS", ""),
                }
            )
        return rows

    @functools.cached_property
    def _slurm_config(self) -> dict[str, str]:
        """The controller's ``scontrol show config`` (``ClusterName``, ``JobCompType``, ...), read
        once per launcher; empty when the controller does not answer."""
        proc = self._run("scontrol", "show", "config", check=False)
        if proc.returncode != 0:
            return {}
        return dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", proc.stdout, re.M))

    def _find_cluster(self) -> str | None:
        return self._slurm_config.get("ClusterName") or None

    def _jobcomp_path(self) -> str | None:
        if self.config.get("jobcomp_loc"):
            return str(self.config["jobcomp_loc"])
        kinds = self._slurm_config
        return kinds.get("JobCompLoc") if kinds.get("JobCompType") == "jobcomp/filetxt" else None

    def _jobcomp(self, job_id: str) -> list[dict[str, str]] | None:
        """Records of ``job_id`` (a job, an array, or one task ``ARRAY_TASK``) in the jobcomp log.

        Later lines win: a cluster whose state was wiped hands out the same job ids again,
        and the log outlives it.
        """
        path = self._jobcomp_path()
        if not path or not os.path.exists(path):
            return None
        array_id, _, task = job_id.partition("_")
        latest: dict[str, dict[str, str]] = {}
        with open(path, errors="replace") as fh:
            for line in fh:
                if f"JobId={array_id} " not in line:  # also matches ArrayJobId=...
                    continue
                row = parse_scontrol(line)
                if row.get("ArrayJobId") == array_id and row.get("ArrayTaskId"):
                    if task and task not in expand_task_ids(row["ArrayTaskId"]):
                        continue
                    latest[f"task {row['ArrayTaskId']}"] = row
                elif row.get("JobId") == array_id and not task:
                    latest.pop("job", None)
                    latest["job"] = row
        return list(latest.values()) or None

    def _rows(self, job_id: str) -> tuple[list[dict[str, str]] | None, str]:
        rows = self._scontrol(job_id)
        if rows:
            return rows, "scontrol"
        try:
            rows = self._sacct(job_id)
        except BackendUnavailable:  # slurmdbd not answering: the jobcomp log may still know the job
            rows = self._jobcomp(job_id)
            if rows:
                return rows, "jobcomp"
            raise
        if rows:
            return rows, "sacct"
        return self._jobcomp(job_id), "jobcomp"

    @staticmethod
    def _wrapper_usage(handle: JobHandle) -> dict[str, float] | None:
        """What the usage wrapper recorded for an ended job: its file, or each task's (summed CPU,
        largest peak), every array task's for an array; None when it wrote nothing."""
        if not handle.log_path:
            return None
        prefix = glob.escape(usage_prefix(handle.log_path)).replace("%a", "*")
        found: list[dict[str, float]] = []
        for path in sorted({*glob.glob(prefix), *glob.glob(prefix + ".*")}):
            try:
                usage = parse_usage(Path(path).read_text())
            except OSError:
                usage = None
            if usage is not None:
                found.append(usage)
        return combine_usage(found)

    def _usage(self, job_id: str, *, wait: float = 5.0) -> dict[str, float] | None:
        """What an ended job used, from sacct (None without accounting, or before it has the job).

        sacct's record of a job lags its end by a second or so: while it still shows the job
        running, this asks again for up to ``wait`` seconds. A cluster without accounting is
        asked once per launcher.
        """
        if not flag_option(self.config, "sacct", True):
            return None
        fields = ["JobID", "State", "MaxRSS", "TotalCPU"]
        deadline = time.monotonic() + wait
        while True:
            proc = self._run("sacct", "-j", job_id, "-n", "-P", "-o", ",".join(fields), check=False)
            if proc.returncode != 0:
                if "accounting storage is disabled" in (proc.stderr + proc.stdout).lower():
                    self.config["sacct"] = False
                return None
            rows = [dict(zip(fields, line.split("|"), strict=False)) for line in proc.stdout.splitlines() if line]
            jobs = [r for r in rows if "." not in r.get("JobID", "")]  # the allocations; steps are ID.batch, ID.0
            ended = bool(jobs) and all(self._row_status({"JobState": r.get("State", "")}).state.terminal for r in jobs)
            if ended or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if not ended:
            return None
        cpu = [parse_sacct_duration(r.get("TotalCPU")) for r in jobs]
        rss = [parse_sacct_bytes(r.get("MaxRSS")) for r in rows if "." in r.get("JobID", "")]
        usage: dict[str, float] = {}
        if cpu and all(c is not None for c in cpu):
            usage["cpu_seconds"] = round(sum(c for c in cpu if c is not None), 3)
        if any(r for r in rss):
            usage["max_rss_bytes"] = max(r for r in rss if r is not None)
        return usage or None

    def status(self, handle: JobHandle) -> JobStatus:
        status = self._status(handle)
        if status.state.terminal and status.state is not JobState.LOST and status.usage is None:
            status.usage = self._wrapper_usage(handle) or self._usage(handle.job_id)
        return status

    def statuses(self, handles: Sequence[JobHandle]) -> list[JobStatus | Exception]:
        """Every handle's state with one ``squeue`` for all of them, then one :meth:`status` for
        each job it does not show pending or running.

        A job that ended needs what squeue does not print (its exit code, what it used, why it
        failed) and an array needs every task, squeue forgetting those that ended ``MinJobAge``
        ago: both are asked about one by one, so each answer is the one :meth:`status` gives.
        """
        if len(handles) < 2:
            return super().statuses(handles)
        try:
            shown = self._squeue([h.job_id for h in handles])
        except LauncherError as exc:  # squeue missing or not answering: so would each status()
            return [exc for _ in handles]
        found: list[JobStatus | Exception] = []
        for handle in handles:
            rows = shown.get(handle.job_id)
            states = [self._row_status(r) for r in rows or ()]
            waits = not any(s.state.terminal or s.reason in NEVER_STARTS for s in states)  # else: _read_status
            if rows and not (handle.extra or {}).get("array") and waits:
                found.append(self._from_rows(handle, rows, states))
            else:
                found.extend(super().statuses([handle]))
        return found

    def _squeue(self, job_ids: list[str]) -> dict[str, list[dict[str, str]]]:
        """squeue's records of plain jobs among ``job_ids`` as scontrol would name their fields,
        keyed by job id (a heterogeneous job's parts under its leader's id); empty when squeue
        knows none of them or fails, which leaves every job to :meth:`status`."""
        fields = {"%i": "JobId", "%T": "JobState", "%r": "Reason", "%N": "NodeList", "%S": "StartTime", "%e": "EndTime"}
        proc = self._run("squeue", "-h", "--states=all", "-j", ",".join(job_ids), "-o", "|".join(fields), check=False)
        if proc.returncode != 0:
            return {}
        rows: dict[str, list[dict[str, str]]] = {}
        for line in proc.stdout.splitlines():
            values = line.split("|")
            if len(values) != len(fields):
                continue
            row = dict(zip(fields.values(), values, strict=True))
            job_id = row["JobId"].partition("+")[0]  # 100+1: part 1 of heterogeneous job 100
            if "_" not in job_id:  # array tasks (123_4, 123_[5-7]) are left to status()
                rows.setdefault(job_id, []).append(row)
        return rows

    def _status(self, handle: JobHandle) -> JobStatus:
        status = self._read_status(handle)
        self._looked[handle.job_id] = (time.monotonic(), status.state.terminal)
        return status

    def _read_status(self, handle: JobHandle, *, end_hopeless: bool = True) -> JobStatus:
        """The job's status from its records. A job Slurm says it will never start (:data:`NEVER_STARTS`)
        is cancelled first (``end_hopeless``) and then reads FAILED with why (:meth:`_row_status`),
        instead of waiting in the queue for ever: with ``--dependency=afterok:`` on a job that
        failed, ``run_job`` never returned."""
        rows, source = self._rows(handle.job_id)
        if not rows:
            reason = f"slurm no longer knows job {handle.job_id} (scontrol, sacct, jobcomp)"
            return JobStatus(JobState.LOST, reason=reason)
        tasks = self._tasks(handle.job_id, rows)
        if tasks and source == "scontrol":
            tasks = self._with_forgotten_tasks(handle, tasks)
        status = aggregate_tasks(tasks) if tasks else self._from_rows(handle, rows, [self._row_status(r) for r in rows])
        if end_hopeless and status.state is JobState.PENDING and status.reason in NEVER_STARTS:
            self._run("scancel", handle.job_id, check=False)  # one that just went is gone all the same
            self._wait_gone(handle)
            return self._read_status(handle, end_hopeless=False)
        return status

    def _with_forgotten_tasks(self, handle: JobHandle, tasks: dict[str, JobStatus]) -> dict[str, JobStatus]:
        """``tasks`` (slurmctld's) with the tasks of the array it no longer shows: slurmctld forgets
        each task ``MinJobAge`` after it ended, while later ones still run, and an array whose failed
        task 0 was forgotten read SUCCEEDED from the tasks left. Those come from sacct (else the
        jobcomp log); one nothing knows is LOST, so the array cannot read as a success."""
        expected = expand_task_ids(str((handle.extra or {}).get("array_tasks") or ""))
        missing = [task for task in expected if task not in tasks]
        if not missing:
            return tasks
        try:
            rows = self._sacct(handle.job_id)
        except BackendUnavailable:  # slurmdbd down: the jobcomp log may know them
            rows = None
        found = self._tasks(handle.job_id, rows or []) or {}
        if any(task not in found for task in missing):
            found = {**(self._tasks(handle.job_id, self._jobcomp(handle.job_id) or []) or {}), **found}
        for task in missing:
            tasks[task] = found.get(task) or JobStatus(
                JobState.LOST,
                reason=f"slurmctld forgot task {task} (MinJobAge) and neither sacct nor the jobcomp log knows it",
            )
        return tasks

    def _ended(self, handle: JobHandle) -> bool:
        """Whether the job has ended, for a log follower, which reads its file far more often:
        slurmctld is asked at most every ``poll_interval`` (the last look at the job, by anyone
        here, answers in between: the look that ``run_job`` makes counts). A 21 s job's follower
        asked 211 times, ``scontrol show job`` each, whatever ``poll_interval`` said."""
        seen = self._looked.get(handle.job_id)
        if seen is not None and time.monotonic() - seen[0] < self.poll_interval:
            return seen[1]
        return self._status(handle).state.terminal

    def _from_rows(self, handle: JobHandle, rows: list[dict[str, str]], states: list[JobStatus]) -> JobStatus:
        """One status from a job's records (several for a heterogeneous job) and each one's own."""
        # several records of one job (a heterogeneous job): running while any part runs; failed if any failed
        for wanted in (JobState.RUNNING, JobState.PENDING, JobState.FAILED, JobState.CANCELLED, JobState.LOST):
            match = [s for s in states if s.state is wanted]
            if match:
                chosen = match[0]
                break
        else:
            chosen = states[0]
        starts = [s.started_at for s in states if s.started_at]
        ends = [s.ended_at for s in states if s.ended_at]
        chosen.started_at = min(starts) if starts else None
        chosen.ended_at = max(ends) if ends and chosen.state.terminal else None
        if chosen.state.terminal and chosen.exit_code:
            first = first_failed_task(task_ends_prefix(handle.log_path) if handle.log_path else None)
            chosen.reason = with_notes(chosen.reason, first)
        if chosen.state.terminal and chosen.exit_code == 127 and handle.log_path:  # a program not on the node
            tail = "\n".join(self.logs(handle, tail=20))
            said = not_started(tail, [self._helpers_python_of(handle)], "slurm", "the node")
            chosen.reason = with_notes(chosen.reason, said)
        return chosen

    def _helpers_python_of(self, handle: JobHandle) -> str:
        """The Python the job's batch script ran the usage wrapper with (a job's own ``python``
        option included), read back from the script; this launcher's setting when the script is
        gone or the handle does not name it (one rebuilt from lineage)."""
        script = (handle.extra or {}).get("script")
        try:
            text = Path(script).read_text() if script else ""
        except OSError:
            text = ""
        found = re.search(r"^OPENLAB_USAGE_PY=(.+)$", text, re.MULTILINE)
        return shlex.split(found.group(1))[0] if found else helpers_python(self.config)

    def _tasks(self, job_id: str, rows: list[dict[str, str]]) -> dict[str, JobStatus] | None:
        """Per-task statuses when ``job_id`` is an array job (not one task of it), else None."""
        if "_" in job_id:
            return None
        tasks: dict[str, JobStatus] = {}
        for row in rows:
            if row.get("ArrayJobId") != job_id:
                continue
            status = self._row_status(row)
            for task in expand_task_ids(row.get("ArrayTaskId")):
                tasks[task] = dataclasses.replace(status)
        return tasks or None

    def task_handle(self, handle: JobHandle, task: str | int) -> JobHandle:
        """A handle on one task of an array: its own status, log (with follow) and cancel."""
        task_id = f"{handle.job_id.partition('_')[0]}_{task}"
        log_path = handle.log_path.replace("%a", str(task)) if handle.log_path else None
        return JobHandle(self.name, task_id, log_path, {"script": handle.extra.get("script"), "array_task": str(task)})

    @staticmethod
    def _row_status(row: dict[str, str]) -> JobStatus:
        raw = row.get("JobState", "").split(" ")[0].upper()
        state, reason = STATE_MAP.get(raw, (JobState.LOST, f"unknown Slurm state {raw or '?'}"))
        code, sig = _exit_code(row.get("ExitCode"))
        if state is JobState.FAILED and reason is None:
            reason = f"killed by signal {sig}" if sig else f"exit code {code}"
            if row.get("Reason") not in (None, "", "None", "NonZeroExitCode"):
                reason += f" ({row['Reason']})"
        if state is JobState.SUCCEEDED and code not in (None, 0):
            state, reason = JobState.FAILED, f"exit code {code}"
        if state is JobState.PENDING and row.get("Reason") not in (None, "", "None"):
            reason = row["Reason"]
        if state is JobState.CANCELLED and row.get("Reason") in NEVER_STARTS:  # cancelled as it could not start
            state, reason, code, sig = JobState.FAILED, never_started(row["Reason"]), None, 0
        if raw == "OUT_OF_MEMORY" and not code:  # sacct says 0:125, which is no signal: the OOM killer's SIGKILL
            code, sig = 128 + signal.SIGKILL, 0
        if raw == "TIMEOUT" and not code and not sig:  # sacct's record: the limit's SIGTERM, as scontrol says it
            code = 128 + signal.SIGTERM
        if sig and code == 0 and state.terminal:
            code = 128 + sig if sig < 128 else code
        if state is JobState.CANCELLED and row.get("CancelledBy"):  # as sacct says it: someone else's cancel shows
            reason = f"cancelled by {_account(row['CancelledBy'])}"
        restarts = int(row.get("Restarts") or 0) if str(row.get("Restarts") or "0").isdigit() else 0
        if restarts and state.terminal:  # Slurm requeued it (PreemptMode=REQUEUE, a node failure, scontrol)
            note = f"requeued {restarts} time{'s' if restarts != 1 else ''} by Slurm and restarted from its script"
            reason = with_notes(reason, note)
        node = row.get("NodeList") or row.get("BatchHost")
        started = _parse_dt(row.get("StartTime")) if state is not JobState.PENDING else None
        return JobStatus(
            state=state,
            exit_code=code if state.terminal else None,
            reason=reason,
            host=node if node not in ("", "(null)", "None", "None assigned") else None,
            started_at=started,
            ended_at=_parse_dt(row.get("EndTime")) if state.terminal else None,
            granted=_granted(row) if started else None,
        )

    # -- logs, cancel, check ---------------------------------------------------------------
    def logs(self, handle: JobHandle, *, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        from orchestrator.launchers.local import follow_file

        # a job id of openlab's own pattern (slurm-%j.log, or slurm-%A_%a.log for ARRAY_TASK) when none was kept
        log_dir = Path(self.config.get("log_dir") or self.settings.logs_dir)
        log_path = handle.log_path or str(log_dir / f"slurm-{handle.job_id}.log")
        if "%a" in log_path:
            return self._array_logs(handle, log_path, follow=follow, tail=tail)
        return follow_file(
            Path(log_path),
            lambda: self._ended(handle),
            follow=follow,
            tail=tail,
            pause=lambda seconds: self.pause(handle, seconds),
        )

    def _array_logs(self, handle: JobHandle, pattern: str, *, follow: bool, tail: int | None) -> Iterator[str]:
        """Every task's log, each line prefixed ``[task]``; ``tail`` counts per task.

        Without ``follow``: task by task, in task order. With ``follow``: lines as they are
        written, from whichever task wrote them, until the whole array has ended and every
        file is drained (tasks start at different times, so new files are picked up as
        they appear).
        """
        from orchestrator.launchers.base import Backoff
        from orchestrator.launchers.local import follow_file

        prefix, _, suffix = pattern.partition("%a")

        def task_files() -> list[tuple[str, Path]]:
            found = []
            for path in glob.glob(glob.escape(prefix) + "*" + glob.escape(suffix)):
                task = path[len(prefix) : len(path) - len(suffix)]
                if task.isdigit():
                    found.append((task, Path(path)))
            return sorted(found, key=lambda item: int(item[0]))

        if not follow:
            for task, path in task_files():
                for line in follow_file(path, lambda: True, follow=False, tail=tail):
                    yield f"[{task}] {line}"
            return
        readers: dict[str, tuple[Any, list[str]]] = {}  # task -> (open file, [partial line])
        backoff = Backoff(self.poll_interval)
        try:
            while True:
                done = self._ended(handle)  # before reading: what a finished array wrote is read below
                for task, path in task_files():
                    if task not in readers:
                        fh = path.open("r", encoding="utf-8", errors="replace")
                        readers[task] = (fh, [""])
                        if tail is not None:
                            lines = fh.read().splitlines(keepends=True)
                            keep = lines[-tail:] if tail > 0 else []
                            if keep and not keep[-1].endswith("\n"):
                                readers[task][1][0] = keep.pop()
                            for line in keep:
                                yield f"[{task}] {line.rstrip(chr(10))}"
                got = False
                for task, (fh, partial) in readers.items():
                    chunk = fh.read()
                    if not chunk:
                        continue
                    got = True
                    *complete, partial[0] = (partial[0] + chunk).split("\n")
                    for line in complete:
                        yield f"[{task}] {line}"
                if done:
                    for task, (_fh, partial) in readers.items():
                        if partial[0]:
                            yield f"[{task}] {partial[0]}"
                    return
                if got:
                    backoff.reset()
                self.pause(handle, backoff.next_delay())
        finally:
            for fh, _partial in readers.values():
                fh.close()

    def cancel(self, handle: JobHandle) -> None:
        status = self._status(handle)  # whether it ended; what it used is not needed here
        if status.state.terminal:
            return
        self._run("scancel", handle.job_id)  # an array's id cancels every task, pending ones too
        self._wait_gone(handle)

    def _wait_gone(self, handle: JobHandle) -> None:
        """Wait until a cancelled job has left the queue (``cancel_timeout``)."""
        timeout = number_option(self.config, "cancel_timeout", 30)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self._run("squeue", "-h", "-j", handle.job_id, "-o", "%T", check=False)
            remaining = [s for s in proc.stdout.split() if s]
            if proc.returncode != 0 or not remaining:
                return
            time.sleep(0.2)
        raise LauncherError(f"slurm job {handle.job_id} is still in the queue {timeout:g}s after scancel")

    def check(self) -> tuple[bool, str]:
        try:
            ping = self._run("scontrol", "ping", check=False, timeout=10)
        except BackendUnavailable as exc:
            return False, str(exc)
        text = (ping.stdout or ping.stderr).strip()
        if ping.returncode != 0 or "UP" not in text:
            return False, f"slurmctld not reachable: {text or 'scontrol ping failed'}"
        info = self._run("sinfo", "-h", "-o", "%P %a %D %t", check=False)
        partitions = ", ".join(" ".join(line.split()) for line in info.stdout.splitlines()) or "no partitions"
        return True, f"{text.splitlines()[0]}; partitions: {partitions}"
