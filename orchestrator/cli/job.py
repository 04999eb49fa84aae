"""``openlab job``: run one command as a job on any backend, and inspect jobs by id.

``openlab job run --backend slurm -- python train.py`` is the smoke test users run
before a long pipeline: it goes through the same launcher and lineage path as a stage
(:func:`orchestrator.launchers.attempts.run_job`), streams the job's log, records the
attempt and exits with the job's own exit code. ``status``, ``logs`` and ``cancel``
take an attempt id (``att_...``, or a unique prefix) or a backend job id, find the
attempt in lineage and revive its handle, so they work from any process.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import typer

from orchestrator.cli.output import given_path
from orchestrator.errors import ConfigError, NotFoundError, OpenlabError, choices

app = typer.Typer(
    help="Run one command as a job (local, docker, slurm, kubernetes) and inspect jobs.", no_args_is_help=True
)

_RUN_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}
#: What ``status``, ``logs`` and ``cancel`` take to name a job.
_ID_HELP = "attempt id (att_...), stage run id (srun_...: its last job) or backend job id"


def _pairs(values: list[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values or []:
        if "=" not in item or not item.split("=", 1)[0]:
            raise OpenlabError(f"invalid {what} {item!r}: use KEY=VALUE")
        key, value = item.split("=", 1)
        out[key] = value
    return out


def _options(values: list[str] | None) -> dict[str, Any]:
    """``--option`` pairs, each value read as a TOML value, as the same key would be in
    ``openlab.toml`` (``mount_workdir=false`` is false, ``grace=10`` a number,
    ``extra_args=["--exclusive"]`` a list); a value that is not TOML (``partition=debug``,
    ``array=0-7%2``) is the string given."""
    import tomllib

    out: dict[str, Any] = {}
    for key, value in _pairs(values, "--option").items():
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = value
    return out


def _default_backend() -> str:
    from orchestrator.settings import load_settings

    return load_settings().default_backend


def _exit_code(status: Any) -> int:
    from orchestrator.launchers import JobState

    if status.state is JobState.SUCCEEDED:
        return 0
    if status.exit_code not in (None, 0):
        return int(status.exit_code) if 0 < int(status.exit_code) < 256 else 1
    return 130 if status.state is JobState.CANCELLED else 1


def _duration(text: str | None, option: str) -> int | None:
    from orchestrator.launchers import parse_duration

    try:
        return parse_duration(text) if text else None
    except OpenlabError as exc:
        raise OpenlabError(f"{option}: {exc}") from None


def _refuse_unknown_option(ctx: typer.Context, first: str) -> None:
    """``job run`` passes options it does not know on to the command (so ``job run python -c X``
    works without ``--``), which made a misspelt option (``--tasks 2 -- train``) the program to
    run: a job that failed with exit 127. No program is named like an option, so refuse it."""
    import difflib

    if not first.startswith("-"):
        return
    known = [name for param in ctx.command.params for name in param.opts if name.startswith("-")]
    close = difflib.get_close_matches(first.split("=", 1)[0], known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "see openlab job run --help"
    raise OpenlabError(f"job run has no option {first!r}: {hint} (the command goes after --)")


@app.command("run", context_settings=_RUN_CONTEXT)
def run_cmd(
    ctx: typer.Context,
    command: list[str] = typer.Argument(None, help="the command to run, after --"),
    backend: str = typer.Option(None, "--backend", "-b", help="local, docker, slurm or kubernetes"),
    image: str = typer.Option(None, "--image", help="container image (docker, kubernetes)"),
    cpus: float = typer.Option(None, "--cpus", help="CPUs for the job"),
    memory: str = typer.Option(None, "--memory", help="memory limit, e.g. 512M or 2G"),
    gpus: int = typer.Option(0, "--gpus", help="GPUs for the job (per node)"),
    nodes: int = typer.Option(
        1, "--nodes", help="machines for the job (slurm, kubernetes; local and docker run on one)"
    ),
    tasks_per_node: int = typer.Option(
        1, "--tasks-per-node", help="processes per machine, each given RANK, WORLD_SIZE, MASTER_ADDR... (every backend)"
    ),
    time_limit: str = typer.Option(
        None, "--time-limit", help="seconds, 1h, 30m, or as sbatch --time: MM:SS, HH:MM:SS, D-HH, D-HH:MM:SS"
    ),
    warn_before_limit: str = typer.Option(
        None,
        "--warn-before-limit",
        help="send the job SIGUSR1 this long before --time-limit, to save and stop (sbatch --signal=USR1@N); 5m",
    ),
    env: list[str] = typer.Option(None, "--env", "-e", help="KEY=VALUE for the job's environment (repeatable)"),
    option: list[str] = typer.Option(
        None,
        "--option",
        "-o",
        help="backend option KEY=VALUE, valued as in openlab.toml: partition=debug, mount_workdir=false (repeatable)",
    ),
    name: str = typer.Option(None, "--name", help="job name (default: the command's first word)"),
    workdir: str = typer.Option(None, "--workdir", help="working directory of the job"),
    artifact_root: Path = typer.Option(
        None, "--artifact-root", parser=given_path, help="mounted at the same path in containers"
    ),
    stage_run: str = typer.Option(None, "--stage-run", help="record the attempt under this stage run id"),
    timeout: float = typer.Option(None, "--timeout", help="give up (and cancel) after this many seconds"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="do not stream the job's log"),
) -> None:
    """Run CMD as one job, stream its log, record the attempt; exit with the job's exit code."""
    from orchestrator.launchers import JobSpec, get_launcher
    from orchestrator.launchers.attempts import run_job
    from orchestrator.lineage.store import open_store
    from orchestrator.settings import load_settings

    if not command:
        raise OpenlabError("no command given: openlab job run [OPTIONS] -- CMD [ARGS...]")
    _refuse_unknown_option(ctx, command[0])
    if timeout is not None and not 0 < timeout < math.inf:
        raise OpenlabError(f"--timeout must be a positive number of seconds, got {timeout:g}")
    settings = load_settings()
    backend = backend or _default_backend()
    launcher = get_launcher(backend, settings)
    labels = {"openlab.io/trigger": "terminal"}
    if stage_run:
        labels["openlab.io/stage-run"] = stage_run
    spec = JobSpec(
        name=name or Path(command[0]).name or "job",
        command=list(command),
        image=image,
        env=_pairs(env, "--env"),
        workdir=workdir,
        artifact_root=artifact_root or settings.artifacts_dir,
        cpus=cpus,
        memory=memory,
        gpus=gpus,
        nodes=nodes,
        tasks_per_node=tasks_per_node,
        time_limit=_duration(time_limit, "--time-limit"),
        warn_before_limit=_duration(warn_before_limit, "--warn-before-limit"),
        labels=labels,
        options=_options(option),
    )

    def echo(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    with open_store(settings) as store:
        attempt, status = run_job(
            store, launcher, spec, stage_run_id=stage_run, on_log=None if quiet else echo, timeout=timeout
        )
    where = f" on {status.host}" if status.host else ""
    detail = f" ({status.reason})" if status.reason else ""
    code = f" exit {status.exit_code}" if status.exit_code is not None else ""  # None: it never started
    sys.stderr.write(
        f"openlab: {backend} job {attempt.job_id}{where}: {status.state}{code}{detail}; "
        f"attempt {attempt.id}, log {attempt.log_path}\n"
    )
    raise typer.Exit(_exit_code(status))


def _find(store: Any, ident: str, backend: str | None) -> tuple[Any, Any, Any]:
    """(attempt or None, handle, launcher) for an attempt id/prefix, a stage run id/prefix (its last
    attempt: "show me pretrain's log" starts from the run's stage list) or a backend job id. A
    recorded job that ran on another cluster than this openlab's backend reaches is refused
    (:class:`~orchestrator.launchers.OtherCluster`): there its id is someone else's job."""
    from sqlmodel import col

    from orchestrator.launchers import JobHandle, get_launcher
    from orchestrator.launchers.attempts import handle_from_attempt
    from orchestrator.lineage.models import Attempt
    from orchestrator.lineage.store import MIN_PREFIX

    attempt = store.get(Attempt, ident)
    if attempt is None and ident.startswith("srun_"):  # a stage run: the job that ran it last
        from orchestrator.lineage.models import StageRun

        stage = store.find(ident)
        if not isinstance(stage, StageRun):
            raise NotFoundError(f"{ident!r} is no stage run")
        tried = store.list(Attempt, stage_run_id=stage.id, order_by=col(Attempt.number).desc(), limit=1)
        if not tried:
            raise NotFoundError(f"stage run {stage.id} ({stage.stage}, {stage.state}) ran no job: nothing to show")
        attempt = tried[0]
    if attempt is None:  # a backend job id: one that names jobs on two clusters is refused, naming each
        attempt = store.find_job(ident, backend=backend)
    if attempt is None and ident.startswith("att_") and len(ident) >= MIN_PREFIX:
        found = store.list(Attempt, where=[col(Attempt.id).startswith(ident, autoescape=True)], limit=2)
        if len(found) > 1:
            raise NotFoundError(f"attempt prefix {ident!r} is ambiguous: give more characters")
        attempt = found[0] if found else None
    if attempt is not None:
        launcher = get_launcher(attempt.backend)
        return attempt, handle_from_attempt(attempt, launcher), launcher
    if backend:
        return None, JobHandle(backend=backend, job_id=ident), get_launcher(backend)
    if ident.startswith("prun_"):  # a pipeline run ran a job per stage: which one is for the person to say
        from orchestrator.lineage.models import StageRun

        run = store.find(ident)  # an id that names nothing is said so
        stages = store.list(StageRun, pipeline_run_id=run.id, order_by=col(StageRun.started_at))
        listed = ", ".join(f"{s.stage} {s.id}" for s in stages if s.state != "REUSED")
        raise NotFoundError(
            f"{run.id} is a pipeline run, a job per stage: give one of its stage runs ({listed})"
            if listed
            else f"{run.id} is a pipeline run that ran no job of its own (its stages were reused)"
        )
    raise NotFoundError(
        f"no attempt or job {ident!r} in lineage; pass --backend to ask a backend about a job openlab did not record"
    )


def _refresh(store: Any, attempt: Any, status: Any) -> None:
    """Bring the attempt up to date when the backend knows more than lineage does."""
    from orchestrator.launchers.attempts import ENDED, finish_attempt, lineage_state, mark_running

    if attempt is None or attempt.state in ENDED:
        return
    if status.state.terminal:
        finish_attempt(store, attempt, status)
    elif lineage_state(status.state) == "RUNNING":
        mark_running(store, attempt, status)


@app.command("status")
def status_cmd(
    ident: str = typer.Argument(..., metavar="ID", help=_ID_HELP),
    backend: str = typer.Option(None, "--backend", "-b", help="backend, for a job id not in lineage"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Show a job's state, exit code, reason, host and times (and update its attempt)."""
    from orchestrator.cli.output import console, describe_task, describe_usage, print_json, say
    from orchestrator.launchers import BackendUnavailable
    from orchestrator.launchers.attempts import ENDED, recorded_status
    from orchestrator.lineage.store import open_store

    recorded = None
    with open_store() as store:
        attempt, handle, launcher = _find(store, ident, backend)
        try:
            status = launcher.status(handle)
        except BackendUnavailable as exc:
            if attempt is None or attempt.state not in ENDED:
                raise
            # an ended job's end is in lineage: said as recorded, with why the backend was not asked
            status, recorded = recorded_status(attempt), f"as recorded when it ended ({handle.backend}: {exc})"
        else:
            _refresh(store, attempt, status)
    data = {
        "attempt": attempt.id if attempt else None,
        "backend": handle.backend,
        "cluster": attempt.cluster if attempt and attempt.cluster else launcher.cluster,
        "job_id": handle.job_id,
        "user": attempt.user if attempt else None,
        "log_path": handle.log_path,
        **status.to_dict(),
    }
    if recorded:
        data["source"] = recorded
    if as_json:
        print_json(data)
        return
    tasks = data.pop("tasks", None)
    used = data.pop("usage", None)
    if used:  # what the job used, as a person reads it
        data["used"] = describe_usage(used)
    for key, value in data.items():
        if value is not None:  # not wrapped by rich: a digest or a path is copied whole
            say(f"{key:>12}: {value}")
    if tasks:  # a job array: one line per task, so a failed shard is easy to spot
        console.print(f"{'tasks':>12}: {len(tasks)}", highlight=False)
        for task, task_status in sorted(tasks.items(), key=lambda kv: (len(kv[0]), kv[0])):
            console.print(f"{task:>12}  {describe_task(task_status)}", highlight=False, markup=False)


@app.command("list")
def list_cmd(
    backend: list[str] | None = typer.Option(None, "--backend", "-b", help="only this backend's jobs; repeatable"),
    state: list[str] | None = typer.Option(
        None, "--state", "-t", help="only jobs the backend says are in this state now: pending or running"
    ),
    stage: list[str] | None = typer.Option(None, "--stage", help="only jobs of this stage; repeatable"),
    recipe: str | None = typer.Option(None, "--recipe", help="only jobs of this recipe's pipeline runs"),
    replica: str | None = typer.Option(None, "--replica", help="only jobs of this replica's pipeline runs"),
    cluster: str | None = typer.Option(None, "--cluster", help="only jobs submitted to this cluster"),
    user: str | None = typer.Option(None, "--user", "-u", help="only jobs this login account submitted"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """The jobs openlab has out now (pending or running in lineage), each asked of its backend
    (Slurm: one squeue for all of them; Kubernetes: one list of Jobs and one of pods per namespace).

    What `squeue` is to a Slurm user, across backends: per job its attempt, backend, job id,
    user (who submitted it), stage, state now, host (for a pending job, why it waits, as squeue
    prints it: `(Priority)`, `(JobHeldUser)`) and age. A job that ended while no openlab process
    watched it (its orchestrator died, a node was lost) is recorded as ended here, as `job status`
    does.

    Narrowed as squeue's `-t`, `-u`, `-M` are: `--state pending`, `--user alice`, `--cluster west`,
    and by what openlab knows of each job: `--stage pretrain`, `--recipe`, `--replica`.
    """
    from orchestrator.cli.output import compact_table, console, narrow, print_json, say
    from orchestrator.launchers.base import known_backend
    from orchestrator.lineage.listing import RecordFilter
    from orchestrator.lineage.models import utcnow
    from orchestrator.lineage.store import open_store

    backend = [known_backend(b, "--backend") for b in backend or ()]
    wanted_states = _states_out(state)
    flt = RecordFilter.from_options(stage=stage, recipe=recipe, replica=replica, cluster=cluster, user=user)
    with open_store() as store:
        rows = _ask_backends(store, _jobs_out(store, flt, backend))
    if wanted_states:  # the state the backend gave now, not the one lineage had
        rows = [row for row in rows if row["state"] in wanted_states]
    if as_json:
        print_json(rows)
        return
    if not rows:
        narrowed = " that match" if wanted_states or flt.given() else ""
        console.print(f"no jobs pending or running{narrowed}", markup=False)
        return
    now = utcnow()
    table = compact_table("openlab jobs out now")
    wide = not narrow()  # the cluster too where there is room (--json always has it)
    for header in (
        "attempt",
        "backend",
        *(("cluster",) if wide else ()),
        "job",
        "user",
        "stage",
        "state",
        "host",
        "age",
    ):
        table.add_column(header, no_wrap=True)
    for row in rows:
        submitted = row["submitted_at"]
        age = _age((now - submitted).total_seconds()) if submitted else ""
        table.add_row(
            row["attempt"],
            row["backend"],
            *((row["cluster"] or "",) if wide else ()),
            row["job_id"] or "",
            row["user"] or "",
            row["stage"] or "",
            _state_cell(row),
            row["host"] or (f"({row['reason']})" if row["reason"] else ""),  # squeue's NODELIST(REASON)
            age,
        )
    console.print(table)
    for row in rows:  # below the table, whole: a reason is too long for a column
        if row["note"]:
            say(f"{row['attempt']}: {row['note']}")


def _jobs_out(store: Any, flt: Any, backends: list[str]) -> list[Any]:
    """The attempts lineage has pending or running, newest first, on ``backends`` (all when empty)
    and passing ``flt``: what lineage knows of each job (its stage, its run's recipe and replica,
    its cluster, who submitted it). What `job list` shows and `job cancel --user ...` cancels."""
    import dataclasses

    from orchestrator.lineage.listing import list_records

    out_now = dataclasses.replace(flt, state=("PENDING", "RUNNING"))
    attempts = list_records(store, ["attempt"], out_now, limit=None, strict=True).records
    return [a for a in attempts if not backends or a.backend in backends]  # --backend repeats; the filter takes one


def _states_out(given: list[str] | None) -> set[str]:
    """``--state pending`` as squeue's ``-t``: the states a job out can be in, upper-case; empty
    when none is given. Anything else is one line (an ended state: where those are listed)."""
    from orchestrator.lineage.listing import KNOWN_STATES

    wanted = {s.strip().upper() for s in given or ()}
    for name in wanted - {"PENDING", "RUNNING"}:  # an ended job is not out: lineage list has those
        hint = choices(name.lower(), ["pending", "running"], label="states of a job out")
        ended = f" (ended jobs: openlab lineage list --kind attempt --state {name})" if name in KNOWN_STATES else ""
        raise ConfigError(f"--state {name.lower()!r}: {hint}{ended}")
    return wanted


def _ask_backends(store: Any, attempts: list[Any]) -> list[dict[str, Any]]:
    """A row per attempt out with what its backend says of the job now (one question per backend
    where it can take many jobs at once), each ended job recorded as ended; a backend that cannot
    be asked leaves lineage's state and a note. What `job list` prints and `job cancel` picks from."""
    from collections import Counter

    from orchestrator.launchers import JobState, get_launcher
    from orchestrator.launchers.attempts import handle_from_attempt, lineage_state
    from orchestrator.lineage.models import StageRun

    rows: list[dict[str, Any]] = []
    launchers: dict[str, Any] = {}
    stages = store.get_many(StageRun, (a.stage_run_id for a in attempts))
    asked: dict[str, list[tuple[dict[str, Any], Any, Any]]] = {}  # backend -> (row, attempt, handle)
    for attempt in attempts:
        srun = stages.get(attempt.stage_run_id or "")
        row: dict[str, Any] = {
            "attempt": attempt.id,
            "backend": attempt.backend,
            "cluster": attempt.cluster,
            "job_id": attempt.job_id,
            "user": attempt.user,
            "stage": srun.stage if srun else None,
            "pipeline_run": srun.pipeline_run_id if srun else None,
            "state": attempt.state,
            "host": attempt.host,
            "submitted_at": attempt.submitted_at,
            "reason": None,
            "tasks": None,
            "note": None,
        }
        rows.append(row)
        if not attempt.job_id:  # recorded before its submission returned a job id
            row["note"] = "no job id yet: being submitted, or its submitter died before the backend answered"
            continue
        try:
            if attempt.backend not in launchers:
                launchers[attempt.backend] = get_launcher(attempt.backend)
            handle = handle_from_attempt(attempt, launchers[attempt.backend])
        except Exception as exc:  # noqa: BLE001 - one unreachable backend must not hide the others' jobs
            row["note"] = _not_asked(exc)
            continue
        asked.setdefault(attempt.backend, []).append((row, attempt, handle))
    for name, jobs in asked.items():
        for (row, attempt, _handle), status in zip(
            jobs, launchers[name].statuses([h for _, _, h in jobs]), strict=True
        ):
            if isinstance(status, Exception):
                row["note"] = _not_asked(status)
                continue
            _refresh(store, attempt, status)
            row["state"] = lineage_state(status.state)
            # a job back in the queue (requeued, preempted) has no host now: its last one hid why it waits
            row["host"] = status.host or (None if status.state is JobState.PENDING else attempt.host)
            if status.state is JobState.PENDING:  # why it waits: Priority, Resources, JobHeldUser...
                row["reason"] = status.reason
            if status.tasks:  # a Slurm array: how far along its tasks are, where squeue prints a line each
                row["tasks"] = dict(Counter(lineage_state(task.state) for task in status.tasks.values()))
            if status.state.terminal:
                row["note"] = f"ended; recorded now{': ' + status.reason if status.reason else ''}"
    return rows


def _state_cell(row: dict[str, Any]) -> str:
    """``RUNNING``, or for an array ``RUNNING 3/8``: tasks ended of all its tasks."""
    tasks = row.get("tasks")
    if not tasks:
        return str(row["state"])
    ended = sum(n for state, n in tasks.items() if state not in ("PENDING", "RUNNING"))
    return f"{row['state']} {ended}/{sum(tasks.values())}"


def _not_asked(exc: BaseException) -> str:
    return f"not asked: {exc}" if isinstance(exc, OpenlabError) else f"not asked: {exc!r}"


def _age(seconds: float) -> str:
    """``45s``, ``12m``, ``3h05m``, ``2d04h``: how long ago, as squeue's TIME column reads."""
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


@app.command("logs")
def logs_cmd(
    ident: str = typer.Argument(..., metavar="ID", help=_ID_HELP),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing until the job ends"),
    tail: int = typer.Option(None, "--tail", "-n", min=0, help="only the last N lines"),
    backend: str = typer.Option(None, "--backend", "-b", help="backend, for a job id not in lineage"),
) -> None:
    """Print a job's log."""
    from orchestrator.lineage.store import open_store
    from orchestrator.secrets import scrub, secret_values

    with open_store() as store:
        _attempt, handle, launcher = _find(store, ident, backend)
    secrets = secret_values()
    for line in launcher.logs(handle, follow=follow, tail=tail):
        sys.stdout.write(scrub(line, secrets) + "\n")
        sys.stdout.flush()


@app.command("cancel")
def cancel_cmd(
    idents: list[str] | None = typer.Argument(None, metavar="[ID...]", help=_ID_HELP + "; several, as scancel takes"),
    backend: str = typer.Option(
        None, "--backend", "-b", help="backend, for a job id not in lineage; with filters, only its jobs"
    ),
    user: str | None = typer.Option(None, "--user", "-u", help="every job out that this account submitted"),
    stage: list[str] | None = typer.Option(None, "--stage", help="every job out of this stage; repeatable"),
    recipe: str | None = typer.Option(None, "--recipe", help="every job out of this recipe's pipeline runs"),
    replica: str | None = typer.Option(None, "--replica", help="every job out of this replica's pipeline runs"),
    cluster: str | None = typer.Option(None, "--cluster", help="every job out on this cluster"),
    state: list[str] | None = typer.Option(
        None, "--state", "-t", help="every job the backend says is in this state now: pending or running"
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="cancel what the filters pick without asking"),
) -> None:
    """Cancel jobs (and everything each started) and record each in its attempt.

    Each ID on its own: one that cannot be found or cancelled is named on stderr and the others
    are still cancelled; the exit code is then 2. Or, as `scancel -u ada` does, every job out
    (pending or running, as `job list` shows them) that `--user`, `--stage`, `--recipe`,
    `--replica`, `--cluster`, `--backend` and `--state` pick: each asked of its backend first, as
    `job list` does, so one that has ended is recorded and left out, and `--state pending` (scancel's
    `-t`) leaves a job that has started since lineage last heard alone. They are listed, then
    cancelled once you agree (`--yes` for scripts; without a terminal to ask on, nothing is
    cancelled without it).
    """
    from orchestrator.cli.output import console, print_error
    from orchestrator.launchers import JobState
    from orchestrator.launchers.base import known_backend
    from orchestrator.lineage.listing import RecordFilter
    from orchestrator.lineage.store import open_store

    flt = RecordFilter.from_options(stage=stage, recipe=recipe, replica=replica, cluster=cluster, user=user)
    wanted_states = _states_out(state)
    if idents and (flt.given() or wanted_states):
        raise ConfigError("give job ids or filters (--user, --stage ...), not both")
    if not idents and not (flt.given() or wanted_states):
        raise ConfigError("name the jobs to cancel: ID..., or filters as scancel takes them (--user ada, --stage S)")
    failed = 0
    with open_store() as store:
        if not idents:
            rows = _ask_backends(store, _jobs_out(store, flt, [known_backend(backend, "--backend")] if backend else []))
            picked = [r for r in rows if r["job_id"] and r["state"] in (wanted_states or {"PENDING", "RUNNING"})]
            if not picked:
                console.print("no jobs pending or running that match", markup=False)
                return
            console.print(f"{len(picked)} job(s) out that match:", markup=False)
            for row in picked:
                console.print(
                    f"  {row['attempt']}  {row['backend']} job {row['job_id']}  {row['state']}"
                    f"  {row['stage'] or '-'}  {row['user'] or '-'}",
                    markup=False,
                )
            if not yes:
                if not sys.stdin.isatty():
                    raise ConfigError(f"{len(picked)} job(s) match and nothing was cancelled: add --yes to cancel them")
                if not typer.confirm(f"cancel these {len(picked)} job(s)?"):
                    print_error("nothing was cancelled")
                    raise typer.Exit(1)
            idents, backend = [row["attempt"] for row in picked], None
        for ident in idents:
            try:
                attempt, handle, launcher = _find(store, ident, backend)
                if attempt is None and launcher.status(handle).state is JobState.LOST:  # said CANCELLED, exit 0
                    raise NotFoundError(
                        f"{handle.backend} knows no job {handle.job_id}, and lineage records none: nothing was "
                        "cancelled (openlab job list shows the jobs out)"
                    )
                launcher.cancel(handle)
                status = launcher.status(handle)
            except OpenlabError as exc:
                if len(idents) == 1:
                    raise
                print_error(f"{ident}: {exc}")
                failed += 1
                continue
            if status.state is JobState.LOST or not status.state.terminal:
                status.state, status.reason = JobState.CANCELLED, status.reason or "cancelled"
            _refresh(store, attempt, status)
            console.print(f"{handle.backend} job {handle.job_id}: {status.state}", highlight=False)
    if failed:
        raise typer.Exit(2)
