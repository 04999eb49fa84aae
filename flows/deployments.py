"""openlab's Prefect deployments: the replica pipeline (run from the UI), the nightlies and upkeep.

Eight deployments, built the same way for ``openlab deploy`` (register only) and
``openlab server`` (register and serve); the three that run training:

- ``replica-pipeline/replica``: parameters recipe, replica, backend, issue, git ref,
  force and dry run, with the schema Prefect derives from the flow's type hints, so
  the UI renders a form with a dropdown for the backend;
- ``nightly-replica/nightly``: a replica of the current main commit on a cron schedule
  (default ``0 2 * * *`` UTC; ``[prefect] nightly_cron`` or a flag changes it);
- ``nightly-replica/nightly-drops``: the same nightly on the ``drops`` replica, the token-dropping
  reproduction, whose verdict compares each dispatch arm's drop fraction (default ``0 4 * * *``
  UTC, after the training nightly; ``[prefect] nightly_drops_cron`` changes it). A dispatch or
  routing change that moves drops is caught the next morning, before a full-scale run pays for it.

The reaper (``lineage-reconcile/reconcile``), the outputs gc (``outputs-gc/gc``) and the daily
digest (``github-digest/daily``: one summary comment per experiment issue, default ``0 7 * * *`` UTC,
``[prefect] digest_cron``; ``""`` registers it without a schedule) are registered with them, and so
are the sweep (``replica-sweep/sweep``) and ``nightly-accept/accept``, which makes a regressed
nightly the baseline on purpose, with a reason (no schedule: a person runs it).

The nightlies, the reaper, the gc and the digest carry a deployment concurrency limit of one with
CANCEL_NEW: a scheduled run that finds the previous one still going is cancelled by the server, not queued.

Registering again keeps what people set on the server: a deployment paused in the UI stays paused,
a schedule switched off stays off (a cron changed in the settings applies, still off), and
``openlab server`` no longer pauses what it served when it stops. ``--resume`` (``openlab deploy``,
``openlab server``) turns everything back on; ``--paused-nightly`` registers the schedules paused.
See :func:`keep_server_state`.

Entrypoints are module paths (``flows.pipeline.replica_pipeline``), so a served run or a
work-pool worker finds the flow wherever openlab is installed. Callers still serve from
:func:`repo_root` (:func:`in_repo_root`), so flow runs start in the repository and
relative paths a person types into the UI (``recipes/x.yaml``) mean the same as in a terminal.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.errors import ConfigError
from orchestrator.settings import Settings, load_settings

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

PIPELINE_DEPLOYMENT = "replica"
NIGHTLY_DEPLOYMENT = "nightly"
DROPS_NIGHTLY_DEPLOYMENT = "nightly-drops"
DROPS_NIGHTLY_REPLICA = "drops"
DEFAULT_NIGHTLY_CRON = "0 2 * * *"
DEFAULT_DROPS_NIGHTLY_CRON = "0 4 * * *"
DEFAULT_NIGHTLY_TIMEZONE = "UTC"
RECONCILE_DEPLOYMENT = "reconcile"
GC_DEPLOYMENT = "gc"
DIGEST_DEPLOYMENT = "daily"
SWEEP_DEPLOYMENT = "sweep"
ACCEPT_DEPLOYMENT = "accept"
DEFAULT_DIGEST_CRON = "0 7 * * *"
DEFAULT_RECONCILE_EVERY_S = 600
#: Where the reaper's interval counts from: a fixed midnight (UTC), so its passes fall on the same times
#: (:00, :10, ... for 600 s) whenever `openlab server` registers it. Prefect anchors an interval at the
#: moment it is built, so each restart moved the next pass a whole interval on (a server restarted more
#: often than that never reaped), and each registration changed the schedule.
INTERVAL_ANCHOR = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
TAGS = ["openlab"]


def repo_root() -> Path:
    """The directory that contains the ``flows`` package (entrypoints are relative to it)."""
    return Path(__file__).resolve().parent.parent


@contextmanager
def in_repo_root() -> Iterator[Path]:
    """Work from :func:`repo_root` for the block, so flow entrypoints are ``flows/<file>.py:<fn>``."""
    before = Path.cwd()
    root = repo_root()
    os.chdir(root)
    try:
        yield root
    finally:
        os.chdir(before)


def nightly_cron(
    settings: Settings | None = None,
    override: str | None = None,
    *,
    key: str = "nightly_cron",
    default: str = DEFAULT_NIGHTLY_CRON,
) -> str:
    """A nightly's cron: the flag, else ``[prefect] <key>``, else ``default`` (02:00 every day for the
    training nightly; ``key="nightly_drops_cron"``, 04:00, for the drop-fraction one)."""
    settings = settings or load_settings()
    cron = str(override or settings.section("prefect").get(key) or default).strip()
    from prefect.client.schemas.schedules import CronSchedule

    what = f"invalid {'nightly ' if 'nightly' in key else ''}cron {cron!r} ([prefect] {key})"
    fields = cron.split()
    if not (len(fields) == 5 or (len(fields) == 1 and cron.startswith("@"))):
        # Prefect takes a sixth field as seconds: "0 2 * * * *" ran 60 times in the minute after 02:00
        raise ConfigError(f"{what}: use five fields, e.g. '0 2 * * *' (02:00 daily), or an alias such as @daily")
    try:
        CronSchedule(cron=cron, timezone=DEFAULT_NIGHTLY_TIMEZONE)
    except ValueError:
        raise ConfigError(f"{what}: use five fields, e.g. '0 2 * * *' (02:00 daily)") from None
    from prefect._vendor.croniter import CroniterBadDateError, croniter  # the cron reader Prefect schedules with

    try:  # "0 2 31 2 *" parses, and never comes: Prefect's scheduler then raised, and no nightly ran
        croniter(cron, dt.datetime.now(dt.UTC), max_years_between_matches=1).get_next(dt.datetime)
    except CroniterBadDateError:
        raise ConfigError(f"{what}: no date within a year matches it (February 31?); give one that comes") from None
    return cron


def reconcile_every(settings: Settings | None = None) -> float:
    """Seconds between scheduled reconcile passes: ``[prefect] reconcile_every_s`` (0: no schedule)."""
    settings = settings or load_settings()
    raw = settings.section("prefect").get("reconcile_every_s", DEFAULT_RECONCILE_EVERY_S)
    try:
        every = float(raw)
    except (TypeError, ValueError):
        every = -1.0
    if not math.isfinite(every) or every < 0 or 0 < every < 60:
        raise ConfigError(
            f"invalid [prefect] reconcile_every_s {raw!r}: use seconds, at least 60 (e.g. 600), or 0 for no schedule"
        )
    return every


def gc_cron(settings: Settings | None = None) -> str | None:
    """When the outputs gc runs for real: ``[prefect] gc_cron`` (none by default: deleting a lab's
    checkpoints on a schedule is a choice someone makes, with the keep rules they chose)."""
    settings = settings or load_settings()
    raw = settings.section("prefect").get("gc_cron")
    return nightly_cron(settings, str(raw), key="gc_cron") if raw else None


def digest_cron(settings: Settings | None = None) -> str | None:
    """When the daily digest is posted: ``[prefect] digest_cron``, 07:00 UTC when unset (after the
    nightlies, so the morning's digest has their verdicts); ``""`` registers it with no schedule,
    as ``reconcile_every_s = 0`` does the reaper (a lab that wants no bot comments, or only from the UI)."""
    settings = settings or load_settings()
    raw = settings.section("prefect").get("digest_cron", DEFAULT_DIGEST_CRON)
    return nightly_cron(settings, str(raw), key="digest_cron") if str(raw).strip() else None


def nightly_timezone(settings: Settings | None = None) -> str:
    """The nightly schedule's time zone (``[prefect] nightly_timezone``, UTC by default)."""
    settings = settings or load_settings()
    zone = str(settings.section("prefect").get("nightly_timezone") or DEFAULT_NIGHTLY_TIMEZONE).strip()
    from prefect.client.schemas.schedules import CronSchedule

    try:  # refused here, in one line, not as pydantic's traceback once a server has started
        CronSchedule(cron="0 2 * * *", timezone=zone)
    except ValueError:
        raise ConfigError(
            f"invalid time zone {zone!r} ([prefect] nightly_timezone): use an IANA name, e.g. 'Europe/Berlin' or 'UTC'"
        ) from None
    return zone


def build_deployments(
    settings: Settings | None = None,
    *,
    cron: str | None = None,
    nightly_parameters: dict[str, Any] | None = None,
    paused_nightly: bool = False,
) -> list[RunnerDeployment]:
    """The pipeline, the two nightlies, the reaper, the outputs gc, the daily digest, the sweep and the
    nightly's accept (not yet registered). Call inside :func:`in_repo_root`.

    ``paused_nightly`` builds every scheduled deployment paused (``--paused-nightly``): registered
    paused, whatever the server had. Otherwise each is built on, and :func:`keep_server_state` (which
    :func:`apply_deployments` and :func:`serve_deployments` call) keeps what the server has paused.
    Each schedule carries a slug, its deployment's name, so registering again updates it in place
    (same id) and knows it after its cron changed.
    """
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.deployments.runner import EntrypointType
    from prefect.schedules import Cron, Interval

    from flows.digest import github_digest
    from flows.gc import collect_outputs
    from flows.nightly import nightly_accept, nightly_replica
    from flows.pipeline import replica_pipeline
    from flows.reconcile import reconcile_lineage
    from flows.sweep import replica_sweep

    settings = settings or load_settings()
    # One run at a time of each scheduled deployment; a run due while the last is still going is
    # cancelled, not queued: a nightly stuck behind a full Slurm queue must not pile up a backlog
    # that then runs back to back, and two reapers at once would race to cancel the same job.
    one_at_a_time = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
    timezone = nightly_timezone(settings)
    drops_cron = nightly_cron(settings, key="nightly_drops_cron", default=DEFAULT_DROPS_NIGHTLY_CRON)
    pipeline = replica_pipeline.to_deployment(
        name=PIPELINE_DEPLOYMENT,
        description=(
            "Run a recipe's scaled-down replica stage by stage: reuse what is done, lease and launch "
            "the rest on the chosen backend, and record lineage. Pick recipe, replica and backend, then Run."
        ),
        tags=TAGS,
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    nightly = nightly_replica.to_deployment(
        name=NIGHTLY_DEPLOYMENT,
        description=(
            "Nightly replica of the current main commit; fails when a tracked metric moved beyond the "
            "recipe's tolerance since the previous successful nightly."
        ),
        schedules=[Cron(nightly_cron(settings, cron), timezone=timezone, slug=NIGHTLY_DEPLOYMENT)],
        parameters=nightly_parameters or None,
        paused=paused_nightly,
        tags=[*TAGS, "nightly"],
        concurrency_limit=one_at_a_time,
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    drops = nightly_replica.to_deployment(
        name=DROPS_NIGHTLY_DEPLOYMENT,
        description=(
            "Nightly token-dropping reproduction (replica drops: data, tokenize, repro) of the current main "
            "commit; fails when an arm's late-window drop fraction moved beyond the recipe's tolerance."
        ),
        schedules=[Cron(drops_cron, timezone=timezone, slug=DROPS_NIGHTLY_DEPLOYMENT)],
        parameters={**(nightly_parameters or {}), "replica": DROPS_NIGHTLY_REPLICA},
        paused=paused_nightly,
        tags=[*TAGS, "nightly", "drops"],
        concurrency_limit=one_at_a_time,
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    every = reconcile_every(settings)
    reaper = reconcile_lineage.to_deployment(
        name=RECONCILE_DEPLOYMENT,
        description=(
            "Close runs whose orchestrator died (lease expired) and cancel their orphaned Slurm jobs, "
            "containers or Kubernetes Jobs; the same pass every pipeline start makes. dry_run only reports."
        ),
        schedules=[Interval(every, anchor_date=INTERVAL_ANCHOR, slug=RECONCILE_DEPLOYMENT)] if every else None,
        paused=paused_nightly,
        tags=[*TAGS, "maintenance"],
        concurrency_limit=one_at_a_time,
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    gc_schedule = gc_cron(settings)
    gc = collect_outputs.to_deployment(
        name=GC_DEPLOYMENT,
        description=(
            "Delete stage outputs (checkpoints, token shards) that no recent, kept or running run uses; "
            "their lineage records stay, marked removed. A dry run unless dry_run is unticked; "
            "[prefect] gc_cron schedules it for real."
        ),
        schedules=[Cron(gc_schedule, timezone=timezone, parameters={"dry_run": False}, slug=GC_DEPLOYMENT)]
        if gc_schedule
        else None,
        paused=paused_nightly,
        tags=[*TAGS, "maintenance"],
        concurrency_limit=one_at_a_time,
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    digest_schedule = digest_cron(settings)
    digest = github_digest.to_deployment(
        name=DIGEST_DEPLOYMENT,
        description=(
            "Post or update today's digest comment on each experiment issue with pipeline runs in the last "
            "24 h: states, commits, failures, key metrics, predictions, verdicts, W&B runs, hours. "
            "[prefect] digest_cron schedules it (07:00 UTC by default)."
        ),
        schedules=[Cron(digest_schedule, timezone=timezone, slug=DIGEST_DEPLOYMENT)] if digest_schedule else None,
        paused=paused_nightly,
        tags=[*TAGS, "github"],
        concurrency_limit=one_at_a_time,
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    sweep = replica_sweep.to_deployment(
        name=SWEEP_DEPLOYMENT,
        description=(
            'Run the replica once per combination of a grid of recipe values ({"pretrain.lr": [0.005, 0.01]}) '
            'and per draw of sampled ones ({"pretrain.lr": "loguniform(0.001,0.03)"}, count), each an ordinary '
            "replica-pipeline run, then publish them side by side: what each set, what it measured."
        ),
        # no grid filled in: one left there when samples are asked for crossed every draw with its values
        tags=[*TAGS, "sweep"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    accept = nightly_accept.to_deployment(
        name=ACCEPT_DEPLOYMENT,
        description=(
            "Make a regressed nightly (its pipeline run, prun_…) the baseline its recipe, replica, backend and "
            "git ref are judged against from now on, with the reason why: kept on its verdict and posted on its "
            "regression issue, which is closed. For a change that moved a tracked metric on purpose."
        ),
        tags=[*TAGS, "nightly"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    return [pipeline, nightly, drops, reaper, gc, digest, sweep, accept]


#: Tag ``make demo`` puts on a scheduled deployment it paused because no runner serves it: that pause
#: is the demo's, not a person's, so the next ``openlab server`` or ``openlab deploy`` lifts it.
DEMO_PAUSED_TAG = "paused-by-demo"


@dataclass
class KeptState:
    """What registering did with the paused state already on the server, to tell the person at the terminal.

    Names are ``flow/deployment``; a schedule is named with its deployment and when it runs.
    """

    #: deployments that exist paused and stay paused (the UI's toggle, ``--paused-nightly`` before)
    paused: list[str] = field(default_factory=list)
    #: schedules that exist inactive and stay inactive: (deployment, "0 4 * * * (UTC)")
    inactive: list[tuple[str, str]] = field(default_factory=list)
    #: ``--resume``: deployments or schedules that were paused and are active again
    resumed: list[str] = field(default_factory=list)
    #: paused by ``make demo`` before (:data:`DEMO_PAUSED_TAG`), active again: a runner serves them now
    resumed_demo: list[str] = field(default_factory=list)
    #: ``make demo``: scheduled deployments paused because no runner serves them
    paused_unserved: list[str] = field(default_factory=list)
    #: openlab's schedules whose time registering changed, as the settings (or a flag) say now, a time set
    #: in the UI included: (deployment, what it was, what it is)
    moved: list[tuple[str, str, str]] = field(default_factory=list)
    #: schedules people added on the server (the UI's "+ Schedule"), kept as they are: (deployment, when)
    added: list[tuple[str, str]] = field(default_factory=list)
    #: every deployment registered existed and was paused (what an older ``openlab server`` left when it stopped)
    every_paused: bool = False

    def off(self, name: str) -> str:
        """`` paused (kept)`` or `` inactive (kept)`` for a deployment left off as the server had it, else ``""``."""
        if name in self.paused:
            return " paused (kept as set on the server)"
        if any(deployment == name for deployment, _ in self.inactive):
            return " inactive (kept as set on the server)"
        return ""

    def lines(self, command: str = "openlab deploy") -> list[str]:
        """What to print: each list that is not empty, one line, and how to resume what was kept off."""
        out: list[str] = []
        if self.paused:
            out.append(f"kept paused, as set on the Prefect server: {', '.join(self.paused)}")
            if self.every_paused:
                out.append(
                    "(every deployment is paused: `openlab server` used to pause all it served when it stopped, "
                    "and no longer does; resume them once)"
                )
        if self.inactive:
            shown = ", ".join(f"{name} schedule {when}" for name, when in self.inactive)
            out.append(f"kept inactive, as set on the Prefect server: {shown}")
        if self.paused or self.inactive:
            out.append(
                f"resume in the Prefect UI (Deployments: its toggle, or its schedule's), or `{command} --resume`"
            )
        if self.moved:
            shown = ", ".join(f"{name} schedule {was} -> {now}" for name, was, now in self.moved)
            out.append(
                f"schedule changed to what the settings say (a time set in the UI does not survive registering; "
                f"[prefect] nightly_cron and the other *_cron settings keep one): {shown}"
            )
        if self.added:
            shown = ", ".join(f"{name} schedule {when}" for name, when in self.added)
            out.append(f"kept as added on the Prefect server (not openlab's, left as they are): {shown}")
        if self.resumed:
            out.append(f"resumed (--resume): {', '.join(self.resumed)}")
        if self.resumed_demo:
            out.append(f"resumed (paused by `make demo`, which serves nothing): {', '.join(self.resumed_demo)}")
        if self.paused_unserved:
            out.append(
                f"registered paused, no runner serves them (`openlab server` resumes them): "
                f"{', '.join(self.paused_unserved)}"
            )
        return out


@dataclass
class Registration:
    """Registered deployments (``{full name: id}``) and what was kept as the server had it."""

    ids: dict[str, str]
    kept: KeptState


def _when(schedule: Any) -> str:
    """A schedule as a person reads it: ``0 2 * * * (UTC)``, ``every 600 s``."""
    cron = getattr(schedule, "cron", None)
    if cron:
        return f"{cron} ({getattr(schedule, 'timezone', None) or DEFAULT_NIGHTLY_TIMEZONE})"
    interval = getattr(schedule, "interval", None)
    if interval is not None:
        return f"every {interval.total_seconds():g} s"
    return str(getattr(schedule, "rrule", schedule))


def _replaced(built: list[Any], existing: list[Any]) -> list[Any]:
    """For each schedule built, the schedule on the server it replaces (or ``None``): the one with its
    slug; else one registered without a slug (by openlab before schedules had slugs), the same schedule
    first, else the first (one schedule a deployment: the cron in the code changed)."""
    unslugged = [s for s in existing if not s.slug]
    out = []
    for schedule in built:
        match = next((s for s in existing if schedule.slug and s.slug == schedule.slug), None)
        if match is None and unslugged:
            match = next((s for s in unslugged if s.schedule == schedule.schedule), unslugged[0])
            unslugged.remove(match)
        out.append(match)
    return out


def _theirs(ours: str, existing: list[Any], replaced: list[Any]) -> list[Any]:
    """The schedules on the server that openlab did not register (neither replaced by a schedule
    built nor slugged ``ours``, the deployment's name), as schedules to send back unchanged."""
    from prefect.client.schemas.actions import DeploymentScheduleCreate

    taken = {old.id for old in replaced if old is not None}
    return [
        DeploymentScheduleCreate(
            schedule=s.schedule,
            active=s.active,
            parameters=s.parameters,
            slug=s.slug,
            max_scheduled_runs=s.max_scheduled_runs,
        )
        for s in existing
        if s.id not in taken and s.slug != ours
    ]


def keep_server_state(
    deployments: Iterable[RunnerDeployment], *, resume: bool = False, pause_unserved: bool = False
) -> KeptState:
    """Before registering again: carry what people set on the server over to the deployments as built.

    Prefect's ``apply()`` (and ``serve()``, which applies) sends ``paused`` (``False`` unless built
    paused) and every schedule's ``active`` (``True``) with each update, so a deployment paused in the
    UI, or a schedule switched off there, came back on at every ``openlab server`` start. Here, for
    each deployment that exists:

    - paused there: built paused (kept). A pause ``make demo`` made (:data:`DEMO_PAUSED_TAG`) is the
      demo's, not a person's: lifted;
    - each schedule gets the ``active`` of the schedule it replaces (same slug; the cron may have
      changed in the code: the new cron applies, switched off as before);
    - a schedule of this deployment that the settings no longer build (``[prefect] digest_cron = ""``)
      is deleted: Prefect keeps slugged schedules an update leaves out;
    - a schedule people added on the server (not one openlab registered) is sent back as it is, with
      its state and parameters, ``resume`` or not: Prefect replaces every schedule of a deployment
      whose schedules are not all slugged (the UI's have none), so it went at the next registration.

    A deployment built paused (``paused_nightly``: ``--paused-nightly``) is registered paused, as
    asked. ``resume``: nothing is kept, every deployment and schedule is registered as built (on).
    ``pause_unserved`` (``make demo``, which serves nothing): a scheduled deployment no runner polls
    (new, or its runner gone) is registered paused, tagged :data:`DEMO_PAUSED_TAG`. Needs the API
    (:func:`orchestrator.prefect_server.use_api`); changes ``deployments`` in place.
    """
    from prefect import get_client
    from prefect.client.schemas.objects import DeploymentStatus
    from prefect.exceptions import ObjectNotFound

    kept = KeptState()
    deployments = list(deployments)
    with get_client(sync_client=True) as client:
        for deployment in deployments:
            name = deployment.full_name
            built = list(deployment.schedules or [])
            try:
                existing = client.read_deployment_by_name(name)
            except ObjectNotFound:
                existing = None
            if existing is None:
                if pause_unserved and built and not deployment.paused:
                    deployment.paused = True
                    deployment.tags = [*deployment.tags, DEMO_PAUSED_TAG]
                    kept.paused_unserved.append(name)
                continue
            for old in existing.schedules:  # ours, no longer wanted: Prefect would keep it
                if old.slug and old.slug == deployment.name and not any(s.slug == old.slug for s in built):
                    with contextlib.suppress(ObjectNotFound):
                        client.delete_deployment_schedule(existing.id, old.id)
            was_demo = DEMO_PAUSED_TAG in (existing.tags or [])
            replaced = _replaced(built, existing.schedules)
            theirs = _theirs(deployment.name, existing.schedules, replaced)
            kept.added.extend((name, _when(s.schedule)) for s in theirs)
            kept.moved.extend(
                (name, _when(old.schedule), _when(new.schedule))
                for new, old in zip(built, replaced, strict=True)
                if old is not None and _when(old.schedule) != _when(new.schedule)
            )
            if resume:
                if existing.paused:
                    kept.resumed.append(name)
                for schedule, old in zip(built, replaced, strict=True):
                    if old is not None and not old.active:
                        kept.resumed.append(f"{name} schedule {_when(schedule.schedule)}")
                deployment.schedules = [*built, *theirs]
                continue
            if deployment.paused:  # built paused: asked for
                pass
            elif existing.paused and not was_demo:
                deployment.paused = True
                kept.paused.append(name)
            elif existing.paused and pause_unserved:  # the demo's pause, and still nobody serves it
                deployment.paused = True
                deployment.tags = [*deployment.tags, DEMO_PAUSED_TAG]
                kept.paused_unserved.append(name)
            elif existing.paused:
                kept.resumed_demo.append(name)
            elif pause_unserved and built and existing.status != DeploymentStatus.READY:
                deployment.paused = True
                deployment.tags = [*deployment.tags, DEMO_PAUSED_TAG]
                kept.paused_unserved.append(name)
            for i, (schedule, old) in enumerate(zip(built, replaced, strict=True)):
                if old is not None and not old.active and schedule.active:
                    built[i] = schedule.model_copy(update={"active": False})
                    kept.inactive.append((name, _when(schedule.schedule)))
            # sent even when none are built: Prefect's update takes the schedules sent as all there are
            deployment.schedules = [*built, *theirs]
    kept.every_paused = bool(deployments) and len(kept.paused) == len(deployments)
    return kept


def check_work_pool(name: str) -> None:
    """Refuse a work pool the server does not have, in one line that says how to make it.

    Prefect's server answers a deployment that names a missing pool with a 500 (``'NoneType' object
    has no attribute 'base_job_template'``), which reached the person as a 54-line traceback; and
    the deployments registered before it, and the schedules :func:`keep_server_state` updates, were
    left half done. Needs the API (:func:`orchestrator.prefect_server.use_api`)."""
    import shlex

    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
        except ObjectNotFound:
            api = str(client.api_url).rstrip("/")
            raise ConfigError(
                f"work pool {name!r} does not exist on {api}: create it "
                f"(prefect work-pool create {shlex.quote(name)} --type process) or leave --work-pool out"
            ) from None


def apply_deployments(
    deployments: Iterable[RunnerDeployment],
    *,
    work_pool: str | None = None,
    resume: bool = False,
    pause_unserved: bool = False,
) -> Registration:
    """Register (create or update) deployments with the API, keeping what is paused there
    (:func:`keep_server_state`; ``resume`` and ``pause_unserved`` as there). A ``work_pool`` the server
    does not have is refused first (:func:`check_work_pool`), before anything is changed there."""
    deployments = list(deployments)
    if work_pool is not None:
        check_work_pool(work_pool)
    kept = keep_server_state(deployments, resume=resume, pause_unserved=pause_unserved)
    out: dict[str, str] = {}
    for deployment in deployments:
        deployment_id = deployment.apply(work_pool_name=work_pool)
        out[deployment.full_name] = str(deployment_id)
    return Registration(ids=out, kept=kept)


def serve_deployments(
    deployments: Iterable[RunnerDeployment],
    *,
    limit: int | None = None,
    resume: bool = False,
    report: Callable[[KeptState], None] | None = None,
) -> None:
    """Serve the deployments in this process until Ctrl-C (or SIGTERM); runs execute as subprocesses.

    ``serve()`` registers them: what is paused on the server stays paused (:func:`keep_server_state`,
    whose answer ``report`` gets before serving starts). Stopping leaves them as they are: Prefect's
    ``pause_on_shutdown`` would pause every served deployment at each Ctrl-C, schedules other people
    rely on included, and, kept paused, they would never come back on.
    """
    from prefect import serve

    deployments = list(deployments)
    kept = keep_server_state(deployments, resume=resume)
    if report is not None:
        report(kept)
    serve(*deployments, limit=limit, pause_on_shutdown=False, print_starting_message=False)


__all__ = [
    "DEFAULT_DIGEST_CRON",
    "DEFAULT_DROPS_NIGHTLY_CRON",
    "DEMO_PAUSED_TAG",
    "DIGEST_DEPLOYMENT",
    "DEFAULT_NIGHTLY_CRON",
    "DROPS_NIGHTLY_DEPLOYMENT",
    "GC_DEPLOYMENT",
    "KeptState",
    "NIGHTLY_DEPLOYMENT",
    "PIPELINE_DEPLOYMENT",
    "RECONCILE_DEPLOYMENT",
    "Registration",
    "SWEEP_DEPLOYMENT",
    "apply_deployments",
    "build_deployments",
    "check_work_pool",
    "digest_cron",
    "gc_cron",
    "in_repo_root",
    "keep_server_state",
    "nightly_cron",
    "reconcile_every",
    "repo_root",
    "serve_deployments",
]
