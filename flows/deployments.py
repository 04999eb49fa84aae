"""openlab's Prefect deployments: the replica pipeline (run from the UI), the nightlies and upkeep.

Six deployments, built the same way for ``openlab deploy`` (register only) and
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
``[prefect] digest_cron``; ``""`` registers it without a schedule) are registered with them.

The nightlies, the reaper, the gc and the digest carry a deployment concurrency limit of one with
CANCEL_NEW: a scheduled run that finds the previous one still going is cancelled by the server, not queued.

Entrypoints are module paths (``flows.pipeline.replica_pipeline``), so a served run or a
work-pool worker finds the flow wherever openlab is installed. Callers still serve from
:func:`repo_root` (:func:`in_repo_root`), so flow runs start in the repository and
relative paths a person types into the UI (``recipes/x.yaml``) mean the same as in a terminal.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
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
DEFAULT_DIGEST_CRON = "0 7 * * *"
DEFAULT_RECONCILE_EVERY_S = 600
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

    try:
        CronSchedule(cron=cron, timezone=DEFAULT_NIGHTLY_TIMEZONE)
    except ValueError:
        raise ConfigError(
            f"invalid {'nightly ' if 'nightly' in key else ''}cron {cron!r} ([prefect] {key}): use five fields, "
            "e.g. '0 2 * * *' (02:00 daily)"
        ) from None
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
    """The pipeline, the two nightlies, the reaper, the outputs gc and the daily digest (not yet
    registered). Call inside :func:`in_repo_root`.

    ``paused_nightly`` registers every schedule paused (``make demo`` runs no runner to take them).
    """
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.deployments.runner import EntrypointType
    from prefect.schedules import Cron, Interval

    from flows.digest import github_digest
    from flows.gc import collect_outputs
    from flows.nightly import nightly_replica
    from flows.pipeline import replica_pipeline
    from flows.reconcile import reconcile_lineage
    from flows.sweep import replica_sweep

    settings = settings or load_settings()
    # One run at a time of each scheduled deployment; a run due while the last is still going is
    # cancelled, not queued: a nightly stuck behind a full Slurm queue must not pile up a backlog
    # that then runs back to back, and two reapers at once would race to cancel the same job.
    one_at_a_time = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
    timezone = nightly_timezone(settings)
    schedule = Cron(nightly_cron(settings, cron), timezone=timezone)
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
        schedules=[schedule],
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
        schedules=[Cron(drops_cron, timezone=timezone)],
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
        schedules=[Interval(every)] if every else None,
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
        schedules=[Cron(gc_schedule, timezone=timezone, parameters={"dry_run": False})] if gc_schedule else None,
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
        schedules=[Cron(digest_schedule, timezone=timezone)] if digest_schedule else None,
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
    return [pipeline, nightly, drops, reaper, gc, digest, sweep]


def apply_deployments(deployments: Iterable[RunnerDeployment], *, work_pool: str | None = None) -> dict[str, str]:
    """Register (create or update) deployments with the API; returns ``{full name: id}``."""
    out: dict[str, str] = {}
    for deployment in deployments:
        deployment_id = deployment.apply(work_pool_name=work_pool)
        out[deployment.full_name] = str(deployment_id)
    return out


def serve_deployments(deployments: Iterable[RunnerDeployment], *, limit: int | None = None) -> None:
    """Serve the deployments in this process until Ctrl-C (or SIGTERM); runs execute as subprocesses."""
    from prefect import serve

    serve(*deployments, limit=limit, print_starting_message=False)


__all__ = [
    "DEFAULT_DIGEST_CRON",
    "DEFAULT_DROPS_NIGHTLY_CRON",
    "DIGEST_DEPLOYMENT",
    "DEFAULT_NIGHTLY_CRON",
    "DROPS_NIGHTLY_DEPLOYMENT",
    "GC_DEPLOYMENT",
    "NIGHTLY_DEPLOYMENT",
    "PIPELINE_DEPLOYMENT",
    "RECONCILE_DEPLOYMENT",
    "SWEEP_DEPLOYMENT",
    "apply_deployments",
    "build_deployments",
    "digest_cron",
    "gc_cron",
    "in_repo_root",
    "nightly_cron",
    "reconcile_every",
    "repo_root",
    "serve_deployments",
]
