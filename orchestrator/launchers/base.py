"""One small interface for running a stage's job on any backend.

Every backend (``local``, ``docker``, ``slurm``, ``kubernetes``) implements
:class:`Launcher`, so flows and the CLI never branch on where a job runs:

- :meth:`Launcher.submit` takes a :class:`JobSpec` and returns a :class:`JobHandle`
  (backend + backend job id + log path). A handle is plain data
  (:meth:`JobHandle.to_dict` / :meth:`JobHandle.from_dict`) so another process, e.g.
  ``openlab job status ID``, can revive it from the attempt recorded in lineage.
- :meth:`Launcher.status` returns a :class:`JobStatus` (:class:`JobState`, exit code,
  reason, host, start/end, image digest).
- :meth:`Launcher.logs` yields log lines (``tail`` the last N, or ``follow`` until the
  job ends); :meth:`Launcher.cancel` ends the job and everything it started;
  :meth:`Launcher.wait` polls until a terminal state or raises :class:`JobTimeout`;
  between polls it calls :meth:`Launcher.pause`, which a backend that can see a job end
  (local: a pidfd on the supervisor; docker: the engine's wait endpoint) overrides to wake
  at once. ``[backends.<name>] poll_interval`` sets the longest gap between two looks.
- :meth:`Launcher.check` says whether the backend is reachable and, if not, why.

:func:`get_launcher` builds a launcher by name from settings
(``[backends.<name>]`` in openlab.toml, overridable by ``OPENLAB_BACKENDS__<NAME>__<KEY>``).
Recording attempts in lineage lives in one place, :mod:`orchestrator.launchers.attempts`.

Why the shape: the four backends differ in everything but these seven verbs, and keeping
the spec backend-neutral (with ``options`` for what only one backend understands:
partition, account, array, namespace, network, ...) lets the same stage run on a
laptop, a Slurm cluster or Kubernetes with the same provenance.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import math
import os
import re
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.errors import ConfigError, OpenlabError, choices
from orchestrator.secrets import SECRET_NAME, redact_mapping, secret_values
from orchestrator.settings import yes_or_no

if TYPE_CHECKING:
    from orchestrator.settings import Settings

log = logging.getLogger(__name__)

#: Label keys that carry lineage ids on containers, Slurm comments and Kubernetes objects.
LABEL_PREFIX = "openlab.io/"
#: Seconds between SIGTERM and SIGKILL when a local or Docker job is cancelled or reaches its time limit
#: (``[backends.NAME] grace``): Slurm's default KillWait and a Kubernetes pod's default
#: terminationGracePeriodSeconds, so a training step can finish and its checkpoint be written on
#: every backend alike. At 5 s a cancel from the Prefect UI killed a step of 10 s mid-way and the
#: retry started over from step 1.
STOP_GRACE = 30
#: The label every job submitted for a lineage attempt carries: the attempt's id. An attempt is
#: recorded before its job is submitted, so when the submitter dies (SIGKILL, a lost node) after the
#: backend took the job and before its id was written, the reaper finds the job by this label
#: (:meth:`Launcher.find`) instead of leaving it to run unrecorded.
ATTEMPT_LABEL = LABEL_PREFIX + "attempt"


class JobState(StrEnum):
    """Where a job is in its life; all but the first two are terminal."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    LOST = "LOST"  # the backend no longer knows the job and no end was seen
    #: Stopped from outside before it ended on its own, and not by us: preempted by a
    #: higher-priority job, evicted, or sent a scheduler's stop signal. Not the job's fault, so
    #: the pipeline runs it again (a training stage resumes from its checkpoint) without
    #: spending a retry: see :func:`stopped_from_outside`.
    PREEMPTED = "PREEMPTED"

    @property
    def terminal(self) -> bool:
        return self not in (JobState.PENDING, JobState.RUNNING)


#: The signals a scheduler stops a job with before killing it: SIGTERM (Slurm preemption with a
#: grace time, Kubernetes eviction, ``docker stop``) and SIGUSR1 (Slurm's warning ahead of a limit,
#: ``--signal=B:USR1@300``). A workload that catches one checkpoints and exits 128 + the signal
#: (:mod:`workloads.moe.util`); one that does not dies by it, which reads the same.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: How every backend begins the reason of a job its own time limit ended (not a preemption: a
#: rerun with the same limit would be stopped again at the same point).
TIME_LIMIT_REASON = "time limit exceeded"


def stopped_from_outside(status: JobStatus) -> JobStatus:
    """``status`` as PREEMPTED when a FAILED job ended by a stop signal (exit code 128 + SIGTERM
    or SIGUSR1) that its own time limit did not send; otherwise ``status`` unchanged.

    Call it only for jobs the caller did not cancel: a cancel also ends a job by SIGTERM.
    Backends that say "preempted" themselves (Slurm's PREEMPTED state) report PREEMPTED directly.
    """
    codes = {128 + int(sig) for sig in STOP_SIGNALS}
    if status.state is not JobState.FAILED or status.exit_code not in codes or status.tasks:
        return status
    if (status.reason or "").startswith(TIME_LIMIT_REASON):
        return status
    name = signal.Signals(status.exit_code - 128).name
    return replace(
        status,
        state=JobState.PREEMPTED,
        reason=f"stopped by {name} from outside (preempted, evicted or warned by its scheduler)",
    )


class LauncherError(OpenlabError):
    """A backend refused or failed an operation; the message quotes the backend's own words."""


class BackendUnavailable(LauncherError):
    """The backend cannot be reached (engine down, controller unreachable, no API server)."""


class ImageNotFound(LauncherError):
    """The job image does not exist where the backend looks for it."""


class JobNotFound(LauncherError):
    """The backend knows no job with this id."""


class OtherCluster(LauncherError):
    """A recorded job ran on another cluster than the one this launcher talks to: its id names
    nothing there, or worse, someone else's job (Slurm counts job ids per cluster)."""


class JobTimeout(TimeoutError, LauncherError):
    """:meth:`Launcher.wait` gave up before the job ended (the job keeps running)."""


@dataclass(frozen=True)
class JobSpec:
    """What to run, backend-neutral.

    ``artifact_root`` is mounted at the same path inside containers and pods so paths
    written into lineage mean the same thing everywhere. ``labels`` carry lineage ids
    (``openlab.io/stage-run`` ...). ``options`` holds backend-specific settings
    (slurm: partition, account, array, qos; docker: network_mode, pids_limit;
    kubernetes: namespace, backoff_limit, ttl_seconds) and overrides configured defaults.
    """

    name: str
    command: list[str]
    image: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None
    artifact_root: Path | None = None
    cpus: float | None = None
    memory: str | None = None
    gpus: int = 0
    time_limit: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    #: A job of several processes: ``nodes`` machines × ``tasks_per_node`` each (``cpus``,
    #: ``memory`` and ``gpus`` are per task, per node and per node, as Slurm counts them). Each
    #: task is told its place the way ``torch.distributed``'s ``env://`` reads it: RANK,
    #: WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT.
    nodes: int = 1
    tasks_per_node: int = 1
    #: Seconds before ``time_limit`` at which the job is sent SIGUSR1, the warning a workload that
    #: checkpoints catches (it saves and exits, and a next attempt resumes): Slurm's
    #: ``--signal=B:USR1@N``, which the local supervisor sends itself, Docker's container a
    #: second ``timeout``, and a Kubernetes pod's usage wrapper (without it the pod is stopped at
    #: its limit with SIGTERM only, which such a workload also saves on).
    warn_before_limit: int | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise OpenlabError("a job needs a command")
        for what in ("nodes", "tasks_per_node"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OpenlabError(f"{what.replace('_', ' ')} must be a whole number of at least 1, got {value!r}")
        if self.cpus is not None and (isinstance(self.cpus, bool) or not 0 < self.cpus < math.inf):
            raise OpenlabError(f"cpus must be a positive number, got {self.cpus!r}")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 0:
            raise OpenlabError(f"gpus must be a whole number of 0 or more, got {self.gpus!r}")
        if self.memory is not None:
            parse_memory_request(self.memory)  # fail early on "lots", "4096" (no unit) and "0"
        if self.time_limit is not None and self.time_limit <= 0:
            raise OpenlabError(f"time limit must be positive, got {self.time_limit}")
        if self.warn_before_limit is not None and not self.time_limit:
            raise OpenlabError(
                f"a warning {self.warn_before_limit} s before the time limit needs a time limit: give one"
            )
        if self.warn_before_limit is not None and not 0 < self.warn_before_limit < self.time_limit:
            raise OpenlabError(
                f"the warning before the time limit must be under the limit ({self.time_limit}), "
                f"got {self.warn_before_limit}"
            )

    @property
    def memory_bytes(self) -> int | None:
        return parse_memory_request(self.memory) if self.memory else None

    @property
    def tasks(self) -> int:
        """How many processes the job runs in all."""
        return self.nodes * self.tasks_per_node

    def resources(self) -> dict[str, Any]:
        """The resources this job asks for, only those set, with its backend options (a Slurm
        partition, a QoS): what its attempt records."""
        asked: dict[str, Any] = {"cpus": self.cpus, "memory": self.memory, "time_limit": self.time_limit}
        if self.gpus:
            asked["gpus"] = self.gpus
        if self.tasks > 1:
            asked.update(nodes=self.nodes, tasks_per_node=self.tasks_per_node)
        if self.warn_before_limit:
            asked["warn_before_limit"] = self.warn_before_limit
        if self.options:
            asked["options"] = dict(self.options)
        return {k: v for k, v in asked.items() if v is not None}

    def public_env(self) -> dict[str, str]:
        """The env with secret values masked, for anything that is printed or recorded."""
        return redact_mapping(self.env)

    def secret_values(self) -> list[str]:
        """Values of the spec's secret-named variables and this process's, to scrub from logs."""
        return secret_values(self.env, os.environ)


@dataclass(frozen=True)
class JobHandle:
    """A submitted job: enough to find it again from any process."""

    backend: str
    job_id: str
    log_path: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "job_id": self.job_id, "log_path": self.log_path, "extra": dict(self.extra)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobHandle:
        return cls(
            backend=str(data["backend"]),
            job_id=str(data["job_id"]),
            log_path=data.get("log_path"),
            extra=dict(data.get("extra") or {}),
        )


@dataclass
class JobStatus:
    """A job's state as the backend reports it.

    ``tasks`` is set for a job made of several tasks (a Slurm job array): each task's own
    status by task id, ordered by id, while the fields above aggregate them (see
    :func:`orchestrator.launchers.slurm.aggregate_tasks`). A user who ran 8 shards needs
    to know *which* shard failed, not just that the job did. None for a single job.
    """

    state: JobState
    exit_code: int | None = None
    reason: str | None = None
    host: str | None = None
    started_at: dt.datetime | None = None
    ended_at: dt.datetime | None = None
    image_digest: str | None = None
    tasks: dict[str, JobStatus] | None = None
    #: What the ended job used, where the backend can say (``max_rss_bytes``, ``cpu_seconds``).
    usage: dict[str, float] | None = None
    #: What the backend gave the job once it started, where that can differ from what it asked for
    #: (Slurm's allocated TRES: a ``--exclusive`` job holds the whole node, a CPU is a whole core):
    #: ``cpus``, ``gpus`` (all nodes together), ``memory_bytes``, ``nodes``. None where not said.
    granted: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tasks"}
        out["state"] = str(self.state)
        for key in ("started_at", "ended_at"):
            out[key] = out[key].isoformat() if out[key] else None
        if self.tasks is not None:
            out["tasks"] = {task: status.to_dict() for task, status in self.tasks.items()}
        return out


class Launcher(ABC):
    """Runs jobs on one backend. Instances are cheap; they hold settings, not jobs."""

    name: str = "base"
    #: Default seconds between status polls in :meth:`wait`.
    poll_interval: float = 0.5
    #: Whether a job may be several tasks (:attr:`JobSpec.nodes`, :attr:`JobSpec.tasks_per_node`),
    #: and on how many machines at most (None: as many as the cluster has).
    multi_task: bool = False
    max_nodes: int | None = 1
    #: Every option this backend reads (``[backends.NAME]`` keys, a job's ``-o``, a recipe's stage
    #: options): any other name is refused by :meth:`check_options`, since a misspelt one
    #: (``partiton``) would otherwise be ignored without a word and the job run somewhere else.
    known_options: frozenset[str] = frozenset({"poll_interval", "python", "cluster", "outage_grace"})
    #: Options that say how this openlab reaches and asks the backend, read from its
    #: ``[backends.NAME]`` settings alone: given to one job (``-o slurm_conf=...``) they were
    #: accepted and ignored, and a job meant for another cluster went to the default one.
    settings_only: frozenset[str] = frozenset({"poll_interval", "outage_grace"})
    #: How long a job is waited for while this backend cannot be asked about it (a slurmctld failing
    #: over, an API server upgrade, a Docker engine restarting) before it is taken to be gone:
    #: ``[backends.NAME] outage_grace`` seconds (:func:`orchestrator.launchers.attempts.run_job`).
    outage_grace: float = 900.0

    def __init__(self, settings: Settings | None = None, config: Mapping[str, Any] | None = None) -> None:
        from orchestrator.settings import load_settings

        self.settings = settings or load_settings()
        self.config: dict[str, Any] = dict(config or {})
        try:
            self.check_options(self.config)
        except ConfigError as exc:
            # a misspelt OPENLAB_BACKENDS__SLURM__PARTITON is in no file: name the variable, or it is not found
            prefix = f"OPENLAB_BACKENDS__{self.name.upper()}__"
            named = sorted(
                n for n in os.environ if n.upper().startswith(prefix) and f"'{n[len(prefix) :].lower()}'" in str(exc)
            )
            where = f" (set by the environment variable {', '.join(named)})" if named else ""
            raise ConfigError(f"[backends.{self.name}]{where} {exc}") from None
        if "poll_interval" in self.config:  # ``[backends.NAME] poll_interval = 5``: gentler on a busy controller
            self.poll_interval = float(self.config["poll_interval"])
        self.outage_grace = number_option(self.config, "outage_grace", type(self).outage_grace)

    def image_name(self, spec: JobSpec) -> str | None:
        """The image reference a job of ``spec`` runs in (None where jobs run on the host)."""
        return spec.image

    @functools.cached_property
    def cluster(self) -> str | None:
        """Where this launcher's jobs run, in the backend's own name for the place: Slurm's
        ClusterName, the Kubernetes API server, the Docker engine's host, this machine for
        local jobs. Each attempt records it, so lineage answers "which job on which cluster",
        and a recorded job is never asked of (or cancelled on) a cluster that did not run it:
        job 4711 on one Slurm cluster is someone else's job on the next. Asked once per
        launcher; None when the backend cannot say (it is down), which refuses nothing.
        ``[backends.NAME] cluster = "coreweave-east"`` names it instead, where the backend's own
        name is an address (a Kubernetes API server) or several sites share one name."""
        return str(self.config["cluster"]) if self.config.get("cluster") else self._found_cluster

    @functools.cached_property
    def _found_cluster(self) -> str | None:
        try:
            return self._find_cluster()
        except Exception as exc:  # noqa: BLE001 - where is informative; the job's own calls say what is wrong
            log.debug("%s backend cannot say which cluster it talks to: %s", self.name, exc)
            return None

    def _find_cluster(self) -> str | None:
        """The backend's answer for :attr:`cluster` (may raise; None: it has no name for it)."""
        return None

    def check_cluster(self, cluster: str | None, what: str) -> None:
        """Raise :class:`OtherCluster` when ``what`` (``attempt att_… (job 4711)``) ran on
        ``cluster`` and this launcher talks to another one. Nothing is refused when either
        side is unknown (an attempt recorded before clusters were, a backend that is down), nor
        for the backend's own name of a cluster since named by the ``cluster`` setting (jobs
        recorded before the setting was made)."""
        here = self.cluster if cluster else None
        own = self._found_cluster if cluster and self.config.get("cluster") else None
        if cluster and here and cluster not in (here, own):
            raise OtherCluster(
                f"{what} ran on {self.name} cluster {cluster!r}, and this openlab's {self.name} backend "
                f"talks to {here!r}: ask from where [backends.{self.name}] reaches {cluster!r}"
            )

    def image_ref(self, image: str | None = None) -> str | None:
        """The image reference a job asking for ``image`` (None: the backend's default) would run in,
        before any job exists: what identities, labels and checks are read from."""
        return self.image_name(JobSpec(name="identity", command=["true"], image=image))

    def environment_image(self, image: str | None = None) -> str | None:
        """What a job's environment *is* on this backend, for stage identities; None: this host's.

        Container backends answer with the image (by digest where it can be known before
        the job runs): the interpreter and packages a job sees are the image's, not the
        orchestrating process's, so a rebuilt image must change what a stage is.
        """
        return None

    def runs_image_code(self) -> bool:
        """Whether jobs run the code baked into their image rather than the host's working tree.

        Where they do, the run's recorded tree is only true of what ran if the image was built
        from it, which :func:`orchestrator.provenance.image.check_image_code` checks.
        """
        return False

    def image_labels(self, image: str | None = None) -> dict[str, str] | None:
        """The labels of the image a job would run; None where they cannot be read here."""
        return None

    @classmethod
    def cannot_run(cls, nodes: int, tasks_per_node: int) -> str | None:
        """Why this backend cannot run a job of ``nodes`` × ``tasks_per_node`` tasks (None: it can)."""
        if nodes * tasks_per_node > 1 and not cls.multi_task:
            return (
                f"the {cls.name} backend runs one task per job, and this job asks for {nodes} node(s) "
                f"× {tasks_per_node} task(s) per node: run it on slurm (or local, on one machine), or as one task"
            )
        if cls.max_nodes is not None and nodes > cls.max_nodes:
            return (
                f"the {cls.name} backend runs a job on one machine, and this job asks for {nodes} nodes: "
                "use slurm or kubernetes"
            )
        return None

    @classmethod
    def check_options(cls, opts: Mapping[str, Any]) -> None:
        """Raise :class:`ConfigError` for a backend option of the wrong kind (``"flase"`` for a
        yes/no, text for a list), so a typo fails in one line instead of doing the opposite of what
        was asked. Called on the backend's settings when the launcher is made, and on a job's
        options before the job is recorded (a recipe's options are checked by its own schema).
        Backends add theirs. An option this backend does not know is refused too (:attr:`known_options`)."""
        unknown = sorted(str(key) for key in opts if str(key) not in cls.known_options)
        if unknown:
            hint = choices(unknown[0], sorted(cls.known_options), label="it has")
            raise ConfigError(f"the {cls.name} backend has no option {unknown[0]!r}: {hint}")
        if "poll_interval" in opts:
            raw = opts["poll_interval"]
            try:
                value = float(raw) if not isinstance(raw, bool) else math.nan
            except (TypeError, ValueError):
                value = math.nan
            if not value > 0:
                raise ConfigError(f"poll_interval must be a positive number of seconds, got {raw!r}")
        number_option(opts, "outage_grace", cls.outage_grace)

    def refuse_unsupported(self, spec: JobSpec) -> None:
        """Refuse, before anything is submitted or recorded, a job this backend cannot run as asked."""
        why = self.cannot_run(spec.nodes, spec.tasks_per_node)
        if why:
            raise ConfigError(why)
        if "cluster" in spec.options:  # where the backend is, not something one job may choose
            raise ConfigError(
                f"cluster is a [backends.{self.name}] setting, the name this openlab gives the place its "
                f"{self.name} jobs run, not an option of one job: set it in openlab.toml"
            )
        own = sorted(str(key) for key in spec.options if str(key) in self.settings_only)
        if own:
            raise ConfigError(
                f"{own[0]} is a [backends.{self.name}] setting (how this openlab reaches and asks the backend), "
                f"not an option of one job: set it in openlab.toml or as OPENLAB_BACKENDS__{self.name.upper()}__"
                f"{own[0].upper()}"
            )
        self.check_options({**self.config, **spec.options})

    @abstractmethod
    def submit(self, spec: JobSpec) -> JobHandle:
        """Start the job; return once the backend has accepted it."""

    @abstractmethod
    def status(self, handle: JobHandle) -> JobStatus:
        """The job's current state."""

    def statuses(self, handles: Sequence[JobHandle]) -> list[JobStatus | Exception]:
        """Each handle's current state, in order; where the backend cannot report one, the error
        in its place, so one bad job does not hide the others' states.

        One :meth:`status` per handle here; a backend that can ask about many jobs in one call
        (Slurm: one ``squeue`` for every running and pending job) answers those that way, which
        is what keeps ``openlab job list`` quick with hundreds of jobs out.
        """
        found: list[JobStatus | Exception] = []
        for handle in handles:
            try:
                found.append(self.status(handle))
            except Exception as exc:  # noqa: BLE001 - handed back in its job's place
                found.append(exc)
        return found

    @abstractmethod
    def logs(self, handle: JobHandle, *, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        """Log lines (without newline); with ``follow``, until the job ends."""

    @abstractmethod
    def find(self, labels: Mapping[str, str]) -> list[JobHandle]:
        """The jobs this backend still knows (running, queued, or ended and not yet cleaned up) whose
        labels include every one of ``labels``.

        How a job is found whose submitter died between the backend taking it and lineage recording its
        id (:data:`ATTEMPT_LABEL`): without it such a job trains on, holding its GPUs, and nobody can
        cancel it. Raises :class:`BackendUnavailable` when the backend cannot be asked now."""

    @abstractmethod
    def cancel(self, handle: JobHandle) -> None:
        """End the job and everything it started; a finished job is left as it is."""

    @abstractmethod
    def check(self) -> tuple[bool, str]:
        """``(reachable, detail)``: detail says what was found or why it is unreachable."""

    def wait(self, handle: JobHandle, timeout: float | None = None, poll: float | None = None) -> JobStatus:
        """Poll :meth:`status` until the job ends; :class:`JobTimeout` after ``timeout`` s."""
        backoff = Backoff(self.poll_interval if poll is None else poll)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status(handle)
            if status.state.terminal:
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise JobTimeout(f"{self.name} job {handle.job_id} still {status.state} after {timeout:g}s")
            self.pause(handle, backoff.next_delay(None if deadline is None else deadline - time.monotonic()))

    def pause(self, handle: JobHandle, seconds: float) -> None:
        """Sleep up to ``seconds`` between two looks at a job; return early if the job may have ended.

        Pollers (:meth:`wait`, log followers, ``run_job``) call this instead of ``time.sleep``
        so a backend that can *see* a job end waits on that instead of sleeping past it: for a
        short job the time to the next poll is most of the overhead. The default just sleeps.
        """
        if seconds > 0:
            time.sleep(seconds)

    def cleanup(self, handle: JobHandle) -> None:  # noqa: B027 - optional hook
        """Release what a finished job still holds (containers, Job objects) once logs are read."""


class Backoff:
    """Poll fast first, then every ``cap`` seconds: short jobs end sooner, long ones cost no more.

    Most of a trivial job's overhead is waiting for the next poll, so the first polls come
    after 10, 20, 40 ... ms; :meth:`reset` starts over (e.g. when a log produced output).
    """

    def __init__(self, cap: float, first: float = 0.01) -> None:
        self.cap, self.first = max(cap, 0.0), first
        self.current = min(first, self.cap)

    def reset(self) -> None:
        self.current = min(self.first, self.cap)

    def next_delay(self, limit: float | None = None) -> float:
        """The next delay (at most ``limit``), advancing the backoff; for callers that wait their own way."""
        delay = self.current if limit is None else max(0.0, min(self.current, limit))
        self.current = min(self.current * 2, self.cap)
        return delay

    def sleep(self, limit: float | None = None) -> None:
        time.sleep(self.next_delay(limit))


# -- parsing helpers shared by backends and the CLI -----------------------------------

_MEM = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)


def parse_memory(text: str) -> int:
    """``"512M"``/``"2G"``/``"1.5Gi"``/``"1048576"`` -> bytes (binary multiples, like Slurm and Docker)."""
    match = _MEM.match(str(text))
    if not match:
        raise OpenlabError(f"invalid memory {text!r}: use a number with K, M, G or T, e.g. 512M or 2G")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** "_KMGT".index(unit)) if unit else int(number)


#: The least memory a job may ask for: Docker refuses a container limit under 6 MiB at the engine, after
#: the attempt is recorded; on every backend a job that small could not start Python.
MIN_JOB_MEMORY = 6 * 2**20


def parse_memory_request(text: str | int) -> int:
    """The memory a job asks for, in bytes: :func:`parse_memory` with a unit required and a floor.

    A bare number means megabytes to ``sbatch --mem`` and bytes to Docker and Kubernetes, so
    ``memory: 4096`` asked Slurm for 4 KiB (``--mem=1M``) and gave a container no room to start;
    and 0, which is "no limit" here, is "all of the node's memory" to ``sbatch --mem=0``. Both are
    refused before anything is recorded; reading sizes a tool printed (sacct's ``0``) stays lenient."""
    bytes_ = parse_memory(str(text))
    if bytes_ and not _MEM.match(str(text)).group(2):  # type: ignore[union-attr]  # parse_memory matched it
        raise OpenlabError(
            f"memory {text!r} has no unit: sbatch reads a bare number as megabytes, Docker and Kubernetes "
            f"as bytes; write it with one, e.g. {text}M or 4G"
        )
    if bytes_ < MIN_JOB_MEMORY:
        raise OpenlabError(
            f"memory {text!r} is under 6M, the least a container can start in: give e.g. 512M or 4G, "
            "or leave memory out for no limit"
        )
    return bytes_


_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_duration(text: str | int) -> int:
    """Seconds from ``90`` (seconds), ``"1h"``, ``"30m"``, ``"1h30m"``, or Slurm's forms:
    ``"MM:SS"``, ``"HH:MM:SS"``, ``"D-HH"``, ``"D-HH:MM"``, ``"D-HH:MM:SS"``.

    After a day count Slurm reads hours first (``1-02:30`` is a day, 2 h and 30 min), without one
    the last field is seconds (``02:30`` is 2 min 30 s); ``squeue`` and ``sacct`` write times in
    the same forms. A bare number is seconds here, where ``sbatch --time`` reads minutes.
    """
    raw = str(text).strip().lower()
    try:
        if raw.isdigit():
            seconds = int(raw)
        elif ":" in raw or re.fullmatch(r"\d+-\d+", raw):
            days, dash, clock = raw.rpartition("-")
            parts = [int(p) for p in clock.split(":")]
            if len(parts) > 3 or any(p < 0 for p in parts) or (dash and not days.isdigit()):
                raise ValueError
            if days:  # D-HH[:MM[:SS]]
                parts += [0] * (3 - len(parts))
            else:  # [HH:]MM:SS
                parts = [0] * (3 - len(parts)) + parts
            seconds = int(days or 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
        else:
            match = _DURATION.match(raw)
            if not match or not raw:
                raise ValueError
            h, m, s = (int(g) if g else 0 for g in match.groups())
            seconds = h * 3600 + m * 60 + s
    except ValueError:
        raise OpenlabError(
            f"invalid time limit {text!r}: use seconds, MM:SS, HH:MM:SS, D-HH, D-HH:MM:SS, or 1h / 30m / 45s"
        ) from None
    if seconds <= 0:
        raise OpenlabError(f"invalid time limit {text!r}: must be positive")
    return seconds


# -- registry ---------------------------------------------------------------------------

BACKENDS: dict[str, str] = {
    "local": "orchestrator.launchers.local:LocalLauncher",
    "docker": "orchestrator.launchers.docker:DockerLauncher",
    "slurm": "orchestrator.launchers.slurm:SlurmLauncher",
    "kubernetes": "orchestrator.launchers.kubernetes:KubernetesLauncher",
}


def warn_secret_arguments(spec: JobSpec, readable_in: str) -> None:
    """Warn, naming the argument, when the job's command carries a secret (``--db-password X``, a secret
    variable's value): lineage records it masked, but the job needs it whole, so it is readable in
    ``readable_in`` (the Kubernetes Job manifest) by whoever may read that. The job still runs: only its
    author can move the value into the job's environment, which that backend keeps in a Secret. (Not
    said on Docker: there the environment is as readable, in ``docker inspect``, as the command.)"""
    from orchestrator.secrets import MASK, redact_argv

    masked = redact_argv(spec.command, spec.secret_values())
    held = [i for i, (a, b) in enumerate(zip(spec.command, masked, strict=True)) if a != b]
    if not held:
        return
    named = ", ".join(
        f"argument {i + 1} ({masked[i - 1]} …)" if i and MASK == masked[i] else f"argument {i + 1} ({masked[i]})"
        for i in held[:3]
    )
    log.warning(
        "job %s: its command holds a secret, %s, readable in %s; pass it in the job's environment instead "
        "(a secret-named variable, kept out of %s)",
        spec.name,
        named,
        readable_in,
        readable_in,
    )


def task_ends_prefix(log_path: str | Path) -> str:
    """Where a multi-task job's tasks write how they ended: ``<log without .log>.ends.<rank>``."""
    return str(log_path).removesuffix(".log") + ".ends"


@dataclass(frozen=True)
class TaskEnd:
    """How one task of a multi-task job ended, as it wrote it."""

    rank: int
    code: int
    host: str
    when: float


def task_ends(ends_prefix: str | None) -> list[TaskEnd]:
    """The ends a multi-task job's tasks wrote (``<prefix>.<rank>``: rank, exit code, host, time; see
    the Slurm wrapper and ``launchers/_tasks.py``), in the order they ended; [] when none."""
    if not ends_prefix:
        return []
    path = Path(ends_prefix)
    ends = []
    for end in path.parent.glob(path.name + ".*"):
        try:
            rank, code, host, when = end.read_text().split()
            ends.append(TaskEnd(int(rank), int(code), host, float(when)))
        except (OSError, ValueError):
            continue
    return sorted(ends, key=lambda e: (e.when, e.rank))


def flag_option(opts: Mapping[str, Any], name: str, default: bool) -> bool:
    """A yes/no backend option. Strings count as well as booleans (``true``, ``off``...), since
    an option may come from an environment or a form as text; any other value is a
    :class:`ConfigError`, because treating ``"false"`` as a non-empty string, true, would do the
    opposite of what was asked."""
    value = opts.get(name, default)
    flag = yes_or_no(value)
    if flag is None:
        raise ConfigError(f"backend option {name} = {value!r} is not yes or no: give true or false")
    return flag


def number_option(opts: Mapping[str, Any], name: str, default: float) -> float:
    """A numeric backend option (seconds, a count), from a number or its text; anything else,
    or a negative number, is a :class:`ConfigError` before the job starts."""
    value = opts.get(name, default)
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise ConfigError(
            f"backend option {name} = {value!r} is not a number of zero or more: give one, e.g. {default}"
        )
    return number


def table_option(opts: Mapping[str, Any], name: str, example: str) -> dict[str, Any]:
    """A backend option that is a table (``mounts``, ``node_selector``); empty when unset, a
    :class:`ConfigError` naming an example when it is something else."""
    value = opts.get(name) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"backend option {name} = {value!r} is not a table: give one, e.g. {name} = {example}")
    return dict(value)


def list_option(opts: Mapping[str, Any], name: str, example: str) -> list[Any]:
    """A backend option that is a list (``extra_args``, ``tolerations``); empty when unset, a
    :class:`ConfigError` naming an example when it is something else."""
    value = opts.get(name) or []
    if not isinstance(value, list | tuple):
        raise ConfigError(f"backend option {name} = {value!r} is not a list: give one, e.g. {name} = {example}")
    return list(value)


#: The image label that names its Python interpreter (set by the repo's Dockerfile): with it,
#: ``measure_usage = "auto"`` runs the usage wrapper in that image, with that interpreter.
PYTHON_LABEL = "openlab.io/python"
#: Where the container backends put their own copies of the helper scripts a job runs under
#: (``launchers/_tasks.py`` as ``tasks.py``, ``launchers/_usage.py`` as ``usage.py``): stdlib-only
#: files run with ``python -I -S``, so a job needs only a Python in its image, not openlab.
HELPERS_MOUNT = "/.openlab"


def helper_script(name: str) -> Path:
    """This launcher's copy of the helper a container runs as ``HELPERS_MOUNT/<name>`` (``tasks.py``,
    ``usage.py``): ``launchers/_<name>``."""
    return Path(__file__).with_name(f"_{name}")


def measure_usage_option(opts: Mapping[str, Any]) -> bool | None:
    """``measure_usage``: True or False as set, None for ``"auto"`` (the default)."""
    if str(opts.get("measure_usage", "auto")).strip().lower() == "auto":
        return None
    return flag_option(opts, "measure_usage", False)


#: The interpreter the helper scripts run with unless a backend's ``python`` option says otherwise:
#: ``python3``, which every image or node with a Python 3 has (Debian's and Ubuntu's packages, the
#: official images, conda, virtualenvs); plain ``python`` exists only where something added it
#: (Debian's ``python-is-python3``).
DEFAULT_PYTHON = "python3"


def helpers_python(opts: Mapping[str, Any]) -> str:
    """The interpreter a backend runs its helper scripts with: option ``python``, else
    :data:`DEFAULT_PYTHON`."""
    return str(opts.get("python") or DEFAULT_PYTHON)


def usage_python(opts: Mapping[str, Any], labels: Mapping[str, str] | None) -> str | None:
    """The interpreter a container backend runs the usage wrapper (``launchers/_usage.py``) with,
    or None to run the job's command as it is. ``measure_usage`` (in ``opts``): ``"auto"`` (the
    default) for images whose ``labels`` name their Python, ``true`` for any image (with
    :func:`helpers_python`), ``false`` never."""
    mode = measure_usage_option(opts)
    if mode is not None:
        return helpers_python(opts) if mode else None
    named = (labels or {}).get(PYTHON_LABEL)
    return str(named) if named else None


def parse_usage(text: str | None) -> dict[str, float] | None:
    """What the usage wrapper wrote (``{"cpu_seconds": ..., "max_rss_bytes": ...}``), or None
    when it wrote nothing readable (not measured; killed with its job, as by the OOM killer)."""
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    usage = {k: data[k] for k in ("cpu_seconds", "max_rss_bytes") if isinstance(data.get(k), int | float)}
    return usage or None


#: The label (Docker) or annotation (Kubernetes) naming the Python(s) a job's helper scripts run
#: with, so that a job whose image has no such program is told which option to set (not_started).
HELPERS_PYTHON_KEY = "openlab.io/helpers-python"

#: A program that could not be started, as docker-init (tini) says it (``exec python failed: No
#: such file or directory``, exit 127), as runc says it (``exec: "python": executable file not
#: found in $PATH``, a container runtime's StartError), as bash says it (``exec: python: not
#: found``, ``python: command not found``, exit 127: Slurm's batch script) and as the helper
#: scripts say it (``openlab: cannot run 'python': No such file or directory``, exit 127).
_NOT_STARTED = re.compile(
    r"exec (?P<tini>\S+) failed: No such file or directory"
    r'|exec: "(?P<runc>[^"]+)": executable file not found'
    r"|exec: (?P<bash_exec>\S+): not found"
    r"|: (?P<bash>[^\s:]+): command not found"
    r"|openlab: cannot run '(?P<ours>[^']+)': No such file or directory"
)


def not_started(text: str | None, helpers: Collection[str], backend: str, where: str = "the image") -> str | None:
    """What a runtime or shell said about a program it could not start (``text``: the end of the
    job's output, or the runtime's message), in a user's words: ``the image has no 'python3'``
    (``where``: "the image", "the node"), and, when that program is a Python the backend runs its
    helper scripts with (``helpers``), which option to set. None when ``text`` says no such thing.
    Without this a job ends "exit code 127" (or 128), and only its log says why."""
    said = list(_NOT_STARTED.finditer(text or ""))
    if not said:
        return None
    found = said[-1]  # the last: the one that ended the job
    program = next(name for name in found.groups() if name)
    note = f"{where} has no {program!r}"
    if program in helpers:
        note += f" to run openlab's helper scripts with: set the {backend} backend's python option to its Python"
    return note


def combine_usage(reports: Iterable[Mapping[str, float]]) -> dict[str, float] | None:
    """What several usage records add up to (the tasks of a job, the pods of an indexed Job, the
    shards of an array): CPU seconds summed, the largest peak memory (the processes ran side by
    side, each with its own memory); None when there is none."""
    reports = list(reports)
    total: dict[str, float] = {}
    if cpu := [r["cpu_seconds"] for r in reports if "cpu_seconds" in r]:
        total["cpu_seconds"] = round(sum(cpu), 3)
    if rss := [r["max_rss_bytes"] for r in reports if "max_rss_bytes" in r]:
        total["max_rss_bytes"] = max(rss)
    return total or None


def with_notes(reason: str | None, *notes: str | None) -> str | None:
    """A job's reason with what the backend adds to it (which task failed first, a requeue, pod
    retries), each after "; "; notes that are None or empty are left out."""
    for note in notes:
        if note:
            reason = f"{reason}; {note}" if reason else note
    return reason


def first_failed_task(ends_prefix: str | None) -> str | None:
    """Which task of a multi-task job failed first, and where, from the ends its tasks wrote;
    None for a job of one task, or when none failed."""
    ends = task_ends(ends_prefix)
    failed = [e for e in ends if e.code != 0]
    if not failed:
        return None
    first = failed[0]
    return f"task {first.rank} of {len(ends)} on {first.host} failed first (exit {first.code}); the others were stopped"


def known_backend(name: str, option: str | None = None) -> str:
    """``name`` as lineage records a backend (``Slurm`` is ``slurm``), or :class:`ConfigError`
    naming the one meant: ``--backend 'slurmm': not a backend; did you mean 'slurm'? ...`` where
    an ``option`` gave it, else ``unknown backend 'slurmm'; ...``. The one check for a backend
    name, wherever it comes from: a run's, a stage's, a filter's (a misspelt filter matched
    nothing, which read as "nothing ran there")."""
    key = (name or "").strip().lower()
    if key not in BACKENDS:
        said = f"{option} {name!r}: not a backend" if option else f"unknown backend {name!r}"
        raise ConfigError(f"{said}; {choices(name, BACKENDS, label='known backends')}")
    return key


def launcher_class(name: str) -> type[Launcher]:
    """The launcher class of backend ``name`` (what it can run, before configuring one)."""
    import importlib

    module_name, cls_name = BACKENDS[known_backend(name)].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def check_backends_section(section: Mapping[str, Any], where: Callable[..., str]) -> None:
    """Raise :class:`ConfigError` for a ``[backends]`` section that names no backend: ``default =
    "slurmm"``, or a table ``[backends.kubernets]`` whose settings no launcher would ever read
    (the jobs would run with none of them). One line, naming the one meant and, through ``where``
    (:func:`orchestrator.settings.check_known`'s), where it was written. Each backend's own options
    are its launcher's to check."""
    for key, value in section.items():
        said = where("backends", key)
        if key == "default":
            if str(value).strip().lower() in BACKENDS:
                continue
            named, what = str(value), f"[backends] default = {value!r}"
        elif key in BACKENDS and isinstance(value, Mapping):
            continue
        elif key in BACKENDS:
            raise ConfigError(
                f"{said}[backends] {key} = {value!r}: the {key} backend's settings are a table, [backends.{key}]"
            )
        else:
            named, what = str(key), f"[backends.{key}]"
        raise ConfigError(f"{said}{what} is not a backend: {choices(named, BACKENDS, label='known backends')}")


def get_launcher(name: str, settings: Settings | None = None, **overrides: Any) -> Launcher:
    """The launcher for backend ``name``, configured from ``[backends.<name>]`` plus ``overrides``."""
    from orchestrator.settings import load_settings

    settings = settings or load_settings()  # its [backends] section checked there
    cls = launcher_class(name)
    config = {**settings.section(f"backends.{cls.name}"), **{k: v for k, v in overrides.items() if v is not None}}
    return cls(settings, config)


def configured_backends(settings: Settings | None = None) -> list[str]:
    """Backends to check: those under ``[backends]`` in config, else all known ones."""
    from orchestrator.settings import load_settings

    settings = settings or load_settings()
    names = [n for n in settings.section("backends") if n in BACKENDS]
    return names or list(BACKENDS)


__all__ = [
    "BACKENDS",
    "Backoff",
    "BackendUnavailable",
    "ImageNotFound",
    "JobHandle",
    "JobNotFound",
    "JobSpec",
    "JobState",
    "JobStatus",
    "JobTimeout",
    "Launcher",
    "LauncherError",
    "SECRET_NAME",
    "configured_backends",
    "get_launcher",
    "first_failed_task",
    "with_notes",
    "task_ends_prefix",
    "known_backend",
    "launcher_class",
    "parse_duration",
    "parse_memory",
    "parse_memory_request",
    "flag_option",
    "list_option",
    "measure_usage_option",
    "number_option",
    "table_option",
]
