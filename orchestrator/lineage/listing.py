"""Which records to list: the filters of ``openlab lineage list``, as SQL over the store.

An audit question is usually a filter, not an id: "which pretrain jobs failed this week", "every
run of the drops replica on slurm since Monday". Each filter names a field of one record kind and,
where the question is about a different kind, reaches it through the run it belongs to: an
attempt's stage is its stage run's, a stage run's recipe is its pipeline run's. A filter that no
requested kind can answer is an error rather than an empty list, so a typo never reads as "none".
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import bindparam, func, or_
from sqlmodel import col, select

from orchestrator.errors import ConfigError, choices
from orchestrator.lineage.models import (
    RECORD_TYPES,
    STATES,
    TRIGGERS,
    Attempt,
    LineageRecord,
    PipelineRun,
    Relation,
    StageRun,
    as_utc,
    utcnow,
)
from orchestrator.lineage.store import LineageStore

#: The column each kind is ordered and time-filtered by: when the thing happened (an attempt's
#: submission, which is always set, before its start, which a job that never started lacks).
TIME_FIELDS = ("submitted_at", "started_at", "created_at", "updated_at")

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


#: The earliest time a span can reach: "since 800000 days ago" is before year 1, which Python's dates
#: start at, and means what "since the beginning" does.
EARLIEST = dt.datetime.min.replace(tzinfo=dt.UTC)
#: The latest time there is (a date late in year 9999 in a zone west of UTC is after it in UTC).
LATEST = dt.datetime.max.replace(tzinfo=dt.UTC)


def utc_minute(when: dt.datetime) -> str:
    """``when`` as ``2026-12-01 14:00`` (its UTC reading). ``%Y`` alone writes year 1 (:data:`EARLIEST`,
    what "unused for 800000d" reaches) as ``1-01-01``, which reads as a typo; this keeps four digits."""
    when = as_utc(when)
    return f"{when.year:04d}-{when:%m-%d %H:%M}"


_WHEN_FORMS = "give a date (2026-12-01), a date and time (2026-12-01T14:00) or a span back from now (90m, 12h, 7d, 2w)"


def parse_when(text: str, *, now: dt.datetime | None = None) -> dt.datetime:
    """A point in time, in UTC, from ``2026-12-01``, ``2026-12-01T14:00`` (UTC unless it says
    otherwise) or a span back from now: ``90m``, ``12h``, ``7d``, ``2w``. A span that reaches before
    year 1 is :data:`EARLIEST` (everything since then is everything); empty text is an error, not
    "no limit"."""
    value = text.strip()
    if not value:
        raise ConfigError(f"no time given ({text!r}): {_WHEN_FORMS}")
    m = _RELATIVE.match(value)
    if m:
        start = as_utc(now or utcnow())
        try:
            return start - dt.timedelta(seconds=float(m.group(1)) * _UNIT_S[m.group(2)])
        except OverflowError:  # past year 1, or more seconds than a timedelta holds
            return EARLIEST
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a time: {_WHEN_FORMS}") from None
    if when.tzinfo is None:
        return when.replace(tzinfo=dt.UTC)
    try:
        return when.astimezone(dt.UTC)
    except OverflowError:  # 0001-01-01T00:00+05:00 is before year 1 in UTC; 9999-12-31T23:00-05:00 after 9999
        return EARLIEST if when.year == dt.MINYEAR else LATEST


@dataclass(frozen=True)
class RecordFilter:
    """What a listing keeps; unset fields keep everything."""

    state: tuple[str, ...] = ()
    stage: tuple[str, ...] = ()
    recipe: str | None = None
    replica: str | None = None
    backend: str | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    #: A commit sha or its prefix (at least 7 characters): runs made at that commit.
    commit: str | None = None
    #: An experiment issue, ``owner/repo#N`` or ``#N``: runs linked to it.
    issue: str | None = None
    #: A machine: jobs that ran on it (any task, any node of a Slurm NodeList), and the stage runs
    #: and runs those jobs belong to: "what did node n17, with the bad GPU, produce last week?"
    host: str | None = None
    #: The cluster a job ran on (:attr:`Attempt.cluster`), and the stage runs and runs of such jobs.
    cluster: str | None = None
    #: The login account that started a run, or submitted a job (squeue's ``-u``).
    user: str | None = None
    #: How the run was started (:data:`~orchestrator.lineage.models.TRIGGERS`): ``schedule`` is the nightlies.
    trigger: str | None = None
    #: A sweep's id (``swp_…``, or a prefix of it): its runs, their stage runs and jobs.
    sweep: str | None = None

    @classmethod
    def from_options(
        cls,
        *,
        state: Sequence[str] | None = None,
        stage: Sequence[str] | None = None,
        recipe: str | None = None,
        replica: str | None = None,
        backend: str | None = None,
        since: str | None = None,
        until: str | None = None,
        commit: str | None = None,
        issue: str | None = None,
        host: str | None = None,
        cluster: str | None = None,
        user: str | None = None,
        trigger: str | None = None,
        sweep: str | None = None,
    ) -> RecordFilter:
        """A filter from command-line text (times as :func:`parse_when` reads them). An option given
        empty (``--user ''``, a variable that was not set) is an error: leaving it out would list,
        or cancel, everything."""
        texts = {"recipe": recipe, "replica": replica, "backend": backend, "commit": commit, "issue": issue}
        texts |= {"host": host, "cluster": cluster, "user": user, "trigger": trigger, "sweep": sweep}
        texts |= {"since": since, "until": until}
        texts |= {"stage": next((s for s in stage or () if not s.strip()), None)}
        texts |= {"state": next((s for s in state or () if not s.strip()), None)}
        empty = next((name for name, value in texts.items() if value is not None and not value.strip()), None)
        if empty is not None:
            raise ConfigError(f"--{empty} is empty: give a value, or leave the option out to keep every record")
        if commit is not None and len(commit.strip()) < 7:
            raise ConfigError(f"--commit {commit!r}: give at least 7 characters of the sha")
        unknown = [s for s in state or () if s.upper() not in KNOWN_STATES]
        if unknown:  # a typo (FAILD) would list nothing, which reads as "nothing failed"
            hint = choices(unknown[0], KNOWN_STATES, label="states")
            raise ConfigError(f"--state {unknown[0]!r}: not a state; {hint}")
        if trigger is not None and trigger.strip().lower() not in TRIGGERS:  # a typo would list nothing
            raise ConfigError(f"--trigger {trigger!r}: not a trigger; {choices(trigger, TRIGGERS, label='triggers')}")
        if backend is not None:
            from orchestrator.launchers.base import known_backend

            backend = known_backend(backend, "--backend")
        start = parse_when(since) if since is not None else None
        end = parse_when(until) if until is not None else None
        if start is not None and end is not None and start >= end:
            raise ConfigError(f"--since {since!r} is not before --until {until!r}: nothing could match; swap them")
        return cls(
            # a job that ended well is SUCCEEDED to its backend and `job status`, COMPLETED in lineage:
            # taken as given, `--state SUCCEEDED` was accepted and matched nothing, "no records match"
            state=tuple(dict.fromkeys("COMPLETED" if s.strip().upper() == "SUCCEEDED" else s for s in state or ())),
            stage=tuple(stage or ()),
            recipe=recipe,
            replica=replica,
            backend=backend,
            since=start,
            until=end,
            commit=commit.strip().lower() if commit else None,
            issue=issue.strip() if issue else None,
            host=host.strip() if host else None,
            cluster=cluster.strip() if cluster else None,
            user=user.strip() if user else None,
            trigger=trigger.strip().lower() if trigger else None,
            sweep=sweep.strip() if sweep else None,
        )

    def given(self) -> list[str]:
        """The filters that are set, by option name."""
        return [f.name for f in fields(self) if getattr(self, f.name) not in (None, ())]


#: What ``--state`` may name: pipeline and stage run states, and SUCCEEDED, how an attempt (a
#: job, :class:`orchestrator.launchers.JobState`) says it ended well: read as COMPLETED, its name in lineage.
KNOWN_STATES = (*STATES, "SUCCEEDED")


#: The filters a pipeline run answers; its stage runs and their jobs answer them too (through
#: the run they belong to where the field is the run's), and ``--stage``.
_RUN_FILTERS = {
    "state",
    "recipe",
    "replica",
    "backend",
    "commit",
    "issue",
    "host",
    "cluster",
    "user",
    "trigger",
    "sweep",
}
#: For each kind, the filters it can answer (time filters apply to every kind with a time).
_ANSWERS: dict[str, set[str]] = {
    "pipeline_run": _RUN_FILTERS,
    "stage_run": _RUN_FILTERS | {"stage"},
    "attempt": _RUN_FILTERS | {"stage"},
}


def time_field(model: type[LineageRecord]) -> str | None:
    return next((f for f in TIME_FIELDS if f in model.model_fields), None)


def answers(kind: str, flt: RecordFilter) -> bool:
    """Whether every filter that is set applies to records of `kind`."""
    can = set(_ANSWERS.get(kind, set()))
    if time_field(RECORD_TYPES[kind]) is not None:
        can |= {"since", "until"}
    return set(flt.given()) <= can


def _attempts_where(session: Any, flt: RecordFilter) -> Any:
    """A statement of the ids of the attempts that ran where ``--host`` and ``--cluster`` say: the
    host among the attempt's (a Slurm NodeList expanded) or any of its tasks' hosts."""
    from orchestrator.launchers.slurm import expand_hostlist

    stmt = select(Attempt.id)
    if flt.cluster:
        stmt = stmt.where(col(Attempt.cluster) == flt.cluster)
    if not flt.host:
        return stmt
    ids = []
    short = flt.host.lower().partition(".")[0]
    # The database narrows it to the jobs on that host by name (short or full: `same_host` decides)
    # and those whose host needs reading: a NodeList (`n[17-19]`, `n17,n18`) or per-task hosts.
    maybe_there = or_(
        func.lower(col(Attempt.host)) == short,
        func.lower(col(Attempt.host)).startswith(f"{short}.", autoescape=True),
        col(Attempt.host).contains("["),
        col(Attempt.host).contains(","),
        col(Attempt.tasks).is_not(None),
    )
    for attempt_id, host, tasks in session.exec(select(Attempt.id, Attempt.host, Attempt.tasks).where(maybe_there)):
        hosts = set(expand_hostlist(host))
        hosts |= {h for task in (tasks or {}).values() for h in expand_hostlist((task or {}).get("host"))}
        if any(same_host(flt.host, h) for h in hosts):
            ids.append(attempt_id)
    # Written into the statement, not bound: a node's jobs over a year can be more ids than
    # PostgreSQL binds in one statement (65,535).
    return stmt.where(col(Attempt.id).in_(bindparam("ran_on_host", ids, expanding=True, literal_execute=True)))


def _statement(kind: str, flt: RecordFilter, session: Any) -> Any:
    model = RECORD_TYPES[kind]
    stmt = select(model)
    when = time_field(model)
    if when is not None:
        column = col(getattr(model, when))
        if flt.since is not None:
            stmt = stmt.where(column >= flt.since)
        if flt.until is not None:
            stmt = stmt.where(column < flt.until)
    if flt.state:
        stmt = stmt.where(func.upper(col(model.state)).in_([s.upper() for s in flt.state]))  # type: ignore[attr-defined]
    # Reach the stage run and the pipeline run a record belongs to, once, only when a filter needs them.
    by_run = bool(flt.commit or flt.issue or flt.sweep)
    needs_stage = kind == "attempt" and bool(flt.stage or flt.recipe or flt.replica or flt.trigger or by_run)
    # A stage run's user is its pipeline run's; an attempt has its own (who submitted the job).
    needs_run = kind != "pipeline_run" and bool(
        flt.recipe or flt.replica or flt.trigger or (kind == "stage_run" and (flt.backend or flt.user))
    )
    if needs_stage:
        stmt = stmt.join(StageRun, col(StageRun.id) == col(Attempt.stage_run_id))
    if needs_run:
        stmt = stmt.join(PipelineRun, col(PipelineRun.id) == col(StageRun.pipeline_run_id))
    if flt.stage:
        stmt = stmt.where(col(StageRun.stage).in_(flt.stage))
    if flt.recipe:
        stmt = stmt.where(col(PipelineRun.recipe) == flt.recipe)
    if flt.replica:
        stmt = stmt.where(col(PipelineRun.replica) == flt.replica)
    if flt.backend:
        # An attempt names the backend its job ran on; a stage run or pipeline run, the one it asked for.
        owner = Attempt if kind == "attempt" else PipelineRun
        stmt = stmt.where(col(owner.backend) == flt.backend)
    if flt.user:
        stmt = stmt.where(col((Attempt if kind == "attempt" else PipelineRun).user) == flt.user)
    if flt.trigger:
        stmt = stmt.where(col(PipelineRun.trigger) == flt.trigger)
    if flt.host or flt.cluster:  # where the jobs ran: an attempt itself, a run through its jobs
        ran_there = _attempts_where(session, flt)
        if kind == "attempt":
            stmt = stmt.where(col(Attempt.id).in_(ran_there))
        else:
            stages = select(Attempt.stage_run_id).where(col(Attempt.id).in_(ran_there))
            if kind == "stage_run":
                stmt = stmt.where(col(StageRun.id).in_(stages))
            else:
                runs = select(StageRun.pipeline_run_id).where(col(StageRun.id).in_(stages))
                stmt = stmt.where(col(PipelineRun.id).in_(runs))
    if by_run:
        # The pipeline run's own relations name its commit and its issue (wasAssociatedWith).
        run_id = col(PipelineRun.id) if kind == "pipeline_run" else col(StageRun.pipeline_run_id)
        if flt.commit:
            stmt = stmt.where(
                run_id.in_(_runs_related("commit", col(Relation.object_id).startswith(flt.commit, autoescape=True)))
            )
        if flt.issue:
            issue = flt.issue
            match = (
                col(Relation.object_id).endswith(issue, autoescape=True)
                if issue.startswith("#")
                else col(Relation.object_id) == issue
            )
            stmt = stmt.where(run_id.in_(_runs_related("github_issue", match)))
        if flt.sweep:  # the id each run of a sweep records (params.sweep.id), or its prefix
            sweep_id = col(PipelineRun.params)["sweep"]["id"].as_string()
            runs = select(PipelineRun.id).where(sweep_id.startswith(flt.sweep, autoescape=True)).correlate(None)
            stmt = stmt.where(run_id.in_(runs))
    return stmt


def _runs_related(kind: str, match: Any) -> Any:
    """Pipeline run ids with a relation to a record of ``kind`` that ``match`` picks."""
    return select(Relation.subject_id).where(
        Relation.subject_kind == PipelineRun.kind, Relation.object_kind == kind, match
    )


@dataclass
class Listing:
    """The records kept, newest first, and how many matched before the limit."""

    records: list[Any]
    matched: int


def list_records(
    store: LineageStore,
    kinds: Sequence[str],
    flt: RecordFilter | None = None,
    *,
    limit: int | None = 50,
    strict: bool = False,
) -> Listing:
    """The newest `limit` records (None: all) of `kinds` that pass `flt`, across kinds, newest first.

    Kinds a set filter does not apply to are left out (``--state FAILED`` lists runs, stage runs
    and attempts, not snapshots); with `strict` (the user named the kinds) each must apply.
    Raises ConfigError for an unknown kind, or a filter asked of kinds that cannot answer it
    (``--stage`` of snapshots): that would list nothing for a reason the user cannot see.
    """
    flt = flt or RecordFilter()
    unknown = [k for k in kinds if k not in RECORD_TYPES]
    if unknown:
        raise ConfigError(f"unknown record kind {unknown[0]!r}; {choices(unknown[0], RECORD_TYPES, label='kinds')}")
    usable = [k for k in kinds if answers(k, flt)]
    if not usable or (strict and len(usable) < len(kinds)):
        kinds = [k for k in kinds if k not in usable]
        given = ", ".join(f"--{name}" for name in flt.given())
        able = sorted(k for k in RECORD_TYPES if answers(k, flt))
        raise ConfigError(
            f"{given} cannot be answered by {', '.join(kinds)} records; "
            + (f"kinds that can: {', '.join(able)}" if able else "no record kind has all of these")
        )
    rows: list[Any] = []
    matched = 0
    with store.session() as session:
        for kind in usable:
            model = RECORD_TYPES[kind]
            stmt = _statement(kind, flt, session)
            matched += session.exec(select(func.count()).select_from(stmt.subquery())).one()
            when = time_field(model)
            if when is not None:
                stmt = stmt.order_by(col(getattr(model, when)).desc())
            rows.extend(session.exec(stmt.limit(limit) if limit is not None else stmt).all())

    def newest(record: Any) -> tuple[bool, dt.datetime]:
        field = time_field(type(record))
        value = getattr(record, field) if field else None
        return (value is not None, value or dt.datetime.min.replace(tzinfo=dt.UTC))

    rows.sort(key=newest, reverse=True)
    if not matched:  # nothing: say so only if the names asked for are names at all
        refuse_unknown_names(store, flt)
    return Listing(records=rows[:limit] if limit is not None else rows, matched=matched)


def refuse_unknown_names(store: LineageStore, flt: RecordFilter) -> None:
    """Raise :class:`ConfigError` for a ``--stage``, ``--recipe`` or ``--replica`` that neither a
    record nor a recipe names, a ``--host`` or ``--cluster`` no job ever ran on (a cluster named in
    ``[backends.NAME] cluster`` is known before its first job), or a ``--user`` who never started a
    run or submitted a job (``--user alcie`` said "no records match"), with the name meant: ``--stage
    pretrian`` listed (and ``job cancel`` cancelled) nothing, and ``lineage affected --host n71``
    said no stage run had a job there, which read as "nothing ran" and "nothing to distrust". A
    known name that matched nothing is no error. Asked only once nothing matched, since it reads
    the recipes and every job's hosts."""
    if flt.host:
        hosts = known_hosts(store)
        if not any(same_host(flt.host, h) for h in hosts):
            hint = _listed(choices(flt.host, hosts, label="hosts jobs ran on"), "hosts jobs ran on", hosts)
            raise ConfigError(f"--host {flt.host!r}: no job in lineage ran on such a host; {hint}")
    if flt.cluster:
        clusters = known_clusters(store)
        if flt.cluster not in clusters:
            hint = choices(flt.cluster, clusters, label="clusters jobs ran on or configured")
            raise ConfigError(f"--cluster {flt.cluster!r}: no job in lineage ran on such a cluster; {hint}")
    if flt.user:
        users = known_users(store)
        if flt.user not in users:
            hint = choices(flt.user, users, label="accounts that started runs or submitted jobs")
            raise ConfigError(f"--user {flt.user!r}: no run or job in lineage is that account's; {hint}")
    asked = [("stage", s) for s in flt.stage] + [(k, getattr(flt, k)) for k in ("recipe", "replica") if getattr(flt, k)]
    if not asked:
        return
    known = _known_names(store)
    for key, name in asked:
        if name not in known[key]:
            hint = choices(name, sorted(known[key]), label=f"{key}s recorded or in the recipes")
            raise ConfigError(f"--{key} {name!r}: no record or recipe has such a {key}; {hint}")


#: At most this many known hosts are listed in a refusal (a cluster has thousands of nodes).
_MOST_LISTED = 20


def _listed(hint: str, label: str, names: Sequence[str]) -> str:
    """``choices``' hint with its list of names cut to :data:`_MOST_LISTED` and the count of all."""
    if len(names) <= _MOST_LISTED:
        return hint
    meant = hint.partition(f"{label}: ")[0]
    return f"{meant}{label} ({len(names)}): {', '.join(names[:_MOST_LISTED])}, …"


def same_host(asked: str, host: str) -> bool:
    """Whether ``--host asked`` names ``host``: as DNS names them, whatever the case, and a short
    name names the machine recorded by its full one, and the other way round: ``--host n17`` finds
    a local job recorded as ``n17.west.lab``, ``--host n17.west.lab`` (copied from monitoring) a
    Slurm job whose NodeList says ``n17``."""
    asked, host = asked.lower(), host.lower()
    if host == asked:
        return True
    if "." in asked and "." in host:  # two full names: the same machine only if the same name
        return False
    return host.partition(".")[0] == asked.partition(".")[0]


def known_hosts(store: LineageStore) -> list[str]:
    """Every host a recorded job ran on, sorted: each node of a Slurm NodeList, each task's host."""
    from orchestrator.launchers.slurm import expand_hostlist

    hosts: set[str] = set()
    with store.session() as session:
        for host in session.exec(select(Attempt.host).where(col(Attempt.host).is_not(None)).distinct()):
            hosts.update(expand_hostlist(host))
        for tasks in session.exec(select(Attempt.tasks).where(col(Attempt.tasks).is_not(None))):
            hosts.update(h for task in (tasks or {}).values() for h in expand_hostlist((task or {}).get("host")))
    return sorted(hosts)


def known_clusters(store: LineageStore) -> list[str]:
    """Every cluster a recorded job ran on and every ``[backends.NAME] cluster`` configured, sorted."""
    from orchestrator.settings import load_settings

    backends = load_settings().section("backends").values()
    configured = {str(table["cluster"]) for table in backends if isinstance(table, dict) and table.get("cluster")}
    with store.session() as session:
        recorded = set(session.exec(select(Attempt.cluster).where(col(Attempt.cluster).is_not(None)).distinct()))
    return sorted(recorded | configured)


def known_users(store: LineageStore) -> list[str]:
    """Every login account that started a recorded run or submitted a recorded job, sorted."""
    with store.session() as session:
        users = set(session.exec(select(PipelineRun.user).where(col(PipelineRun.user).is_not(None)).distinct()))
        users |= set(session.exec(select(Attempt.user).where(col(Attempt.user).is_not(None)).distinct()))
    return sorted(users)


def _known_names(store: LineageStore) -> dict[str, set[str]]:
    """Every stage, recipe and replica name in the store or in the shipped recipes."""
    from orchestrator.recipes.recipe import shipped_names
    from orchestrator.recipes.schema import STAGES

    recipes, replicas = shipped_names()
    known: dict[str, set[str]] = {"stage": set(STAGES), "recipe": recipes, "replica": replicas}
    with store.session() as session:
        known["stage"] |= {s for s in session.exec(select(StageRun.stage).distinct()) if s}
        for recipe, replica in session.exec(select(PipelineRun.recipe, PipelineRun.replica).distinct()):
            known["recipe"] |= {recipe} if recipe else set()
            known["replica"] |= {replica} if replica else set()
    return known


__all__ = [
    "EARLIEST",
    "LATEST",
    "Listing",
    "RecordFilter",
    "answers",
    "list_records",
    "parse_when",
    "known_clusters",
    "known_hosts",
    "known_users",
    "same_host",
    "utc_minute",
    "refuse_unknown_names",
    "time_field",
]
