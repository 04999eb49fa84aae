"""``openlab deploy``: register the replica pipeline and the nightly as Prefect deployments.

Registration is separate from serving so a team can point openlab at a shared Prefect
server (``--api-url`` or ``PREFECT_API_URL``) and let workers of a work pool
(``--work-pool``) execute the runs; on a laptop ``openlab server`` registers and serves
in one go. Registering again updates the deployments in place (same names, same schedule ids)
and keeps what people set on the server: a deployment paused in the UI stays paused, a schedule
switched off stays off, with its new cron if the settings changed it; what was kept is printed.
``--resume`` turns everything back on; ``--paused-nightly`` registers every schedule paused.
"""

from __future__ import annotations

import os

import typer

from orchestrator.cli.output import say
from orchestrator.errors import OpenlabError
from orchestrator.prefect_server import DEFAULT_HOST, DEFAULT_PORT, health_ok, use_api
from orchestrator.secrets import scrub
from orchestrator.settings import Settings, load_settings


def resolve_api_url(settings: Settings, flag: str | None = None) -> str:
    """The Prefect API to talk to: the flag, ``PREFECT_API_URL``, ``[prefect] api_url``, or the local default."""
    section = settings.section("prefect")
    url = flag or os.environ.get("PREFECT_API_URL") or section.get("api_url")
    if not url:
        url = f"http://{section.get('host') or DEFAULT_HOST}:{section.get('port') or DEFAULT_PORT}/api"
    return str(url).rstrip("/")


def deploy(
    api_url: str = typer.Option(None, "--api-url", help="Prefect API URL (default: PREFECT_API_URL or local)."),
    nightly_cron: str = typer.Option(
        None,
        "--nightly-cron",
        help="Cron for the nightly, in [prefect] nightly_timezone (UTC) ([prefect] nightly_cron, default '0 2 * * *').",
    ),
    work_pool: str = typer.Option(
        None, "--work-pool", help="Work pool whose workers run the flows (default: none, `openlab server` serves)."
    ),
    paused_nightly: bool = typer.Option(False, "--paused-nightly", help="Register every schedule paused."),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Resume every deployment and schedule paused on the server (else they stay paused, as set in the UI).",
    ),
) -> None:
    """Create or update the ``replica-pipeline/replica``, ``nightly-replica/nightly``,
    ``nightly-replica/nightly-drops``, ``lineage-reconcile/reconcile``, ``outputs-gc/gc`` and
    ``github-digest/daily`` deployments, keeping what the server has paused unless ``--resume``."""
    from flows.deployments import (
        DEFAULT_DROPS_NIGHTLY_CRON,
        DIGEST_DEPLOYMENT,
        DROPS_NIGHTLY_DEPLOYMENT,
        GC_DEPLOYMENT,
        NIGHTLY_DEPLOYMENT,
        RECONCILE_DEPLOYMENT,
        apply_deployments,
        build_deployments,
        digest_cron,
        gc_cron,
        in_repo_root,
        nightly_timezone,
        reconcile_every,
    )
    from flows.deployments import nightly_cron as resolve_cron

    if resume and paused_nightly:
        raise OpenlabError("--resume and --paused-nightly ask for opposite things: give one")
    settings = load_settings()
    url = resolve_api_url(settings, api_url)
    if not health_ok(url):
        shown = scrub(url, ())  # a password in the URL (a proxy's basic auth) is not printed
        raise OpenlabError(f"no Prefect API answers at {shown}: start one with `openlab server`, or pass --api-url")
    cron = resolve_cron(settings, nightly_cron)
    zone = nightly_timezone(settings)  # every schedule's (nightlies, gc, digest)
    with use_api(url), in_repo_root():
        built = build_deployments(settings, cron=cron, paused_nightly=paused_nightly)
        done = apply_deployments(built, work_pool=work_pool, resume=resume)
    full_name = {d.name: d.full_name for d in built}
    ui = scrub(url, ()).removesuffix("/api")  # printed in every link below: its password masked
    for name, deployment_id in done.ids.items():
        say(f"deployed {name}  {ui}/deployments/deployment/{deployment_id}")

    def paused(name: str) -> str:  # how a schedule's deployment was left: asked paused, or kept paused
        return " paused" if paused_nightly else done.kept.off(full_name[name])

    say(f"nightly schedule: {cron} ({zone}){paused(NIGHTLY_DEPLOYMENT)}")
    drops_cron = resolve_cron(settings, key="nightly_drops_cron", default=DEFAULT_DROPS_NIGHTLY_CRON)
    say(f"drop-fraction nightly schedule: {drops_cron} ({zone}){paused(DROPS_NIGHTLY_DEPLOYMENT)}")
    every = reconcile_every(settings)
    reaper = (
        f"every {every:g} s{paused(RECONCILE_DEPLOYMENT)}"
        if every
        else "none (run it from the UI or `openlab lineage reconcile`)"
    )
    say(f"reconcile schedule: {reaper}")
    gc_schedule = gc_cron(settings)
    gc_says = (
        f"{gc_schedule} ({zone}){paused(GC_DEPLOYMENT)}"
        if gc_schedule
        else "none (a dry run from the UI; [prefect] gc_cron sets one)"
    )
    say(f"outputs gc schedule: {gc_says}")
    digest_schedule = digest_cron(settings)
    digest_says = (
        f"{digest_schedule} ({zone}){paused(DIGEST_DEPLOYMENT)}"
        if digest_schedule
        else "none (run it from the UI or `openlab github digest`; [prefect] digest_cron sets one)"
    )
    say(f"github digest schedule: {digest_says}")
    for line in done.kept.lines("openlab deploy"):
        say(line)
    if work_pool is None:
        say("runs execute where the deployments are served: keep `openlab server` running")


if __name__ == "__main__":  # `python -m orchestrator.cli.deploy`: usable before it is mounted
    import sys

    from orchestrator.cli.output import print_error

    try:
        alone = typer.Typer(add_completion=False, pretty_exceptions_enable=False)  # one command: runs as it
        alone.command()(deploy)
        alone(prog_name="openlab deploy")
    except OpenlabError as exc:
        print_error(exc)
        sys.exit(exc.exit_code)
