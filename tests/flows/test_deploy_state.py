"""Registering again (``openlab deploy``, ``openlab server``) keeps what people set in the Prefect UI.

A deployment paused there stays paused, a schedule switched off stays off (with the new cron when the
settings changed it), stopping ``openlab server`` pauses nothing, ``--resume`` turns it all back on,
and ``make demo``'s own pauses (no runner) are lifted by the next registration. The UI's toggles are
the client calls used here: ``pause_deployment`` and ``update_deployment_schedule(active=False)``.

These tests pause and resume the deployments, so they run against a Prefect server of their own, not
the session's, whose runner serves the same deployment names for the other flow tests.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from orchestrator.prefect_server import PrefectServer, use_api
from tests.flows.conftest import REPO_ROOT, runner_env, running_prefect_server, stop_process, wait_for_deployments

pytestmark = [pytest.mark.prefect]

PIPELINE = "replica-pipeline/replica"
NIGHTLY = "nightly-replica/nightly"
DROPS = "nightly-replica/nightly-drops"
RECONCILE = "lineage-reconcile/reconcile"
GC = "outputs-gc/gc"
DIGEST = "github-digest/daily"
SWEEP = "replica-sweep/sweep"
ACCEPT = "nightly-accept/accept"
ALL = [PIPELINE, NIGHTLY, DROPS, RECONCILE, GC, DIGEST, SWEEP, ACCEPT]
SCHEDULED = [NIGHTLY, DROPS, RECONCILE, DIGEST]  # gc has no schedule unless [prefect] gc_cron


@pytest.fixture(scope="module")
def deploy_state_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A Prefect server for this module alone; this process's client points at it."""
    with running_prefect_server(tmp_path_factory.mktemp("deploy-state-prefect")) as server:
        yield server


@pytest.fixture
def server(deploy_state_server: PrefectServer) -> PrefectServer:
    """The module's server with no deployments: each test registers from scratch."""
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterTags

    with use_api(deploy_state_server.api_url), get_client(sync_client=True) as client:
        ours = DeploymentFilter(tags=DeploymentFilterTags(all_=["openlab"]))
        for deployment in client.read_deployments(deployment_filter=ours):
            client.delete_deployment(deployment.id)
    return deploy_state_server


def _deploy(server: PrefectServer, home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(  # noqa: S603 - our interpreter, fixed arguments
        [sys.executable, "-m", "orchestrator.cli.deploy", "--api-url", server.api_url, *args],
        cwd=REPO_ROOT,
        env={**runner_env(server, home), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done


def _read(name: str) -> Any:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_deployment_by_name(name)


def _paused() -> set[str]:
    return {name for name in ALL if _read(name).paused}


def _schedule(name: str) -> Any:
    (schedule,) = _read(name).schedules
    return schedule


def _pause(name: str) -> None:
    """What the deployment's toggle in the UI does."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        client.pause_deployment(_read(name).id)


def _switch_off(name: str) -> None:
    """What a schedule's toggle in the UI does."""
    from prefect import get_client

    deployment = _read(name)
    (schedule,) = deployment.schedules
    with get_client(sync_client=True) as client:
        client.update_deployment_schedule(deployment.id, schedule.id, active=False)


def _settings(home: Path, **values: str) -> Any:
    from orchestrator.settings import load_settings

    config = home / "openlab.toml"
    if not config.exists():
        config.write_text("")
    return load_settings(environ={"OPENLAB_HOME": str(home), "OPENLAB_CONFIG": str(config), **values})


def _register(home: Path, *, demo: bool = False, **kwargs: Any) -> Any:
    """Register in this process as ``openlab deploy`` does (``demo``: as ``make demo`` does)."""
    from flows.deployments import apply_deployments, build_deployments, in_repo_root

    settings = _settings(home)
    if demo:
        from orchestrator.demo import register_deployments

        return register_deployments(settings)
    with in_repo_root():
        return apply_deployments(build_deployments(settings), **kwargs)


def test_deploy_again_keeps_a_paused_deployment_and_a_switched_off_schedule(
    server: PrefectServer, tmp_path: Path
) -> None:
    first = _deploy(server, tmp_path)
    assert first.returncode == 0, first.stderr
    assert _paused() == set() and all(_schedule(name).active for name in SCHEDULED)
    drops_schedule_id = _schedule(DROPS).id
    _pause(NIGHTLY)
    _switch_off(DROPS)

    again = _deploy(server, tmp_path)
    assert again.returncode == 0, again.stderr
    assert _paused() == {NIGHTLY}, "a deployment paused in the UI stays paused; the others stay on"
    assert not _schedule(DROPS).active and _schedule(NIGHTLY).active
    assert all(_schedule(name).active for name in (RECONCILE, DIGEST))
    assert _schedule(DROPS).id == drops_schedule_id, "the schedule is updated in place (its slug), not recreated"
    out = " ".join(again.stdout.split())
    assert f"kept paused, as set on the Prefect server: {NIGHTLY}" in out, out
    assert f"kept inactive, as set on the Prefect server: {DROPS} schedule 0 4 * * * (UTC)" in out, out
    assert "`openlab deploy --resume`" in out, out
    assert "nightly schedule: 0 2 * * * (UTC) paused (kept as set on the server)" in out, out
    assert "drop-fraction nightly schedule: 0 4 * * * (UTC) inactive (kept as set on the server)" in out, out
    assert "reconcile schedule: every 600 s" in out and "every 600 s paused" not in out, out

    # the cron changes in the settings and on the command line: the new cron applies, still off
    moved = _deploy(server, tmp_path, "--nightly-cron", "15 1 * * *", OPENLAB_PREFECT__NIGHTLY_DROPS_CRON="30 5 * * *")
    assert moved.returncode == 0, moved.stderr
    nightly, drops = _read(NIGHTLY), _read(DROPS)
    assert nightly.paused and nightly.schedules[0].schedule.cron == "15 1 * * *" and nightly.schedules[0].active
    assert not drops.paused and drops.schedules[0].schedule.cron == "30 5 * * *" and not drops.schedules[0].active
    assert drops.schedules[0].id == drops_schedule_id
    assert f"{DROPS} schedule 30 5 * * * (UTC)" in " ".join(moved.stdout.split())
    assert f"{NIGHTLY} schedule 0 2 * * * (UTC) -> 15 1 * * * (UTC)" in " ".join(moved.stdout.split()), moved.stdout

    # --resume is the explicit way back (and refuses to be combined with --paused-nightly)
    both = _deploy(server, tmp_path, "--resume", "--paused-nightly")
    assert both.returncode == 2 and "--resume and --paused-nightly" in both.stderr and "Traceback" not in both.stderr
    resumed = _deploy(server, tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert _paused() == set() and all(_schedule(name).active for name in SCHEDULED)
    out = " ".join(resumed.stdout.split())
    assert f"resumed (--resume): {NIGHTLY}, {DROPS} schedule 0 4 * * * (UTC)" in out, out
    assert "kept paused" not in out and "kept inactive" not in out

    # --paused-nightly pauses the scheduled ones, as asked, and the next plain deploy keeps them so
    asked = _deploy(server, tmp_path, "--paused-nightly")
    assert asked.returncode == 0, asked.stderr
    assert _paused() == {NIGHTLY, DROPS, RECONCILE, GC, DIGEST}
    kept = _deploy(server, tmp_path)
    assert kept.returncode == 0 and _paused() == {NIGHTLY, DROPS, RECONCILE, GC, DIGEST}, kept.stdout


def test_a_schedule_registered_before_slugs_keeps_its_state_and_a_removed_one_goes(
    server: PrefectServer, tmp_path: Path
) -> None:
    """Deployments an earlier openlab registered (schedules without a slug) keep their switched-off
    schedule through the first registration that gives them one; a schedule the settings no longer
    build is removed (Prefect keeps slugged schedules an update leaves out)."""
    from flows.deployments import build_deployments, in_repo_root

    with in_repo_root():
        old = build_deployments(_settings(tmp_path))
    for deployment in old:  # as openlab registered them before: no slugs, Prefect's own apply()
        deployment.schedules = [s.model_copy(update={"slug": None}) for s in deployment.schedules or []]
        deployment.apply()
    assert _schedule(DROPS).slug is None
    _switch_off(DROPS)
    _pause(RECONCILE)

    done = _register(tmp_path)
    drops = _schedule(DROPS)
    assert not drops.active and _paused() == {RECONCILE}
    assert drops.slug == "nightly-drops" and drops.schedule.cron == "0 4 * * *"
    assert _schedule(RECONCILE).slug == "reconcile"
    assert done.kept.paused == [RECONCILE] and done.kept.inactive == [(DROPS, "0 4 * * * (UTC)")]

    from flows.deployments import apply_deployments

    no_digest = _settings(tmp_path, OPENLAB_PREFECT__DIGEST_CRON="")
    with in_repo_root():
        apply_deployments(build_deployments(no_digest))
    assert _read(DIGEST).schedules == [] and not _schedule(DROPS).active


def test_stopping_openlab_server_pauses_nothing_and_a_restart_keeps_what_the_ui_paused(
    server: PrefectServer, tmp_path: Path
) -> None:
    """Prefect's serve() pauses every served deployment when it stops; a Ctrl-C of one `openlab server`
    paused schedules other people rely on (and, kept paused, they would never come back)."""
    env = runner_env(server, tmp_path)

    def start(log_name: str) -> tuple[subprocess.Popen[bytes], Path]:
        log_path = tmp_path / log_name
        with log_path.open("wb") as log:
            proc = subprocess.Popen(  # noqa: S603 - our interpreter, fixed arguments
                [sys.executable, "-m", "orchestrator.cli.server", "--api-url", server.api_url],
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return proc, log_path

    def wait_served(since: datetime, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        """Until the runner has registered every deployment and polls for their runs."""
        wait_for_deployments(ALL, 90, proc, log_path)
        deadline = time.monotonic() + 90
        while not all((_read(name).last_polled or since) > since for name in ALL):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)

    proc, log_path = start("server-1.log")
    try:
        wait_served(datetime.now(UTC), proc, log_path)
        assert _paused() == set()
    finally:
        code = stop_process(proc)
    assert code == 0, log_path.read_text()[-3000:]
    assert _paused() == set(), "stopping openlab server paused the deployments it served"

    _pause(DROPS)  # the cluster is down for maintenance: someone pauses one nightly, switches the reaper off
    _switch_off(RECONCILE)
    restarted = datetime.now(UTC)
    proc, log_path = start("server-2.log")
    try:
        wait_served(restarted, proc, log_path)
        assert _paused() == {DROPS}, "a restart resumed what the UI paused"
        assert not _schedule(RECONCILE).active and _schedule(NIGHTLY).active
        text = " ".join(log_path.read_text().split())
        assert f"kept paused, as set on the Prefect server: {DROPS}" in text, text[-3000:]
        assert f"kept inactive, as set on the Prefect server: {RECONCILE} schedule every 600 s" in text, text[-3000:]
        assert "`openlab server --resume`" in text, text[-3000:]
        # `make demo` against a server an `openlab server` serves: it leaves the served deployments on
        demo = _register(tmp_path, demo=True)
        assert demo.kept.paused_unserved == [] and _paused() == {DROPS}
    finally:
        code = stop_process(proc)
    assert code == 0, log_path.read_text()[-3000:]
    assert _paused() == {DROPS} and not _schedule(RECONCILE).active, "a stop leaves everything as it was"


def test_make_demo_pauses_what_no_runner_serves_and_the_next_registration_resumes_it(
    server: PrefectServer, tmp_path: Path
) -> None:
    demo = _register(tmp_path, demo=True)
    paused_by_demo = {NIGHTLY, DROPS, RECONCILE, DIGEST}  # the scheduled ones; gc has no schedule by default
    assert _paused() == paused_by_demo, "no runner serves them: their runs would pile up, Late"
    assert sorted(demo.kept.paused_unserved) == sorted(paused_by_demo)
    assert "paused-by-demo" in _read(NIGHTLY).tags and "paused-by-demo" not in _read(PIPELINE).tags
    assert _register(tmp_path, demo=True).kept.paused_unserved, "a second demo keeps them paused"
    assert _paused() == paused_by_demo

    done = _register(tmp_path)  # what `openlab server` / `openlab deploy` does next
    assert _paused() == set(), "the demo's pause is not a person's: lifted"
    assert sorted(done.kept.resumed_demo) == sorted(paused_by_demo) and done.kept.paused == []
    assert "paused-by-demo" not in _read(NIGHTLY).tags
    assert any("paused by `make demo`" in line for line in done.kept.lines())

    _pause(RECONCILE)  # a person's pause survives a demo and the registration after it
    _register(tmp_path, demo=True)
    assert _paused() == paused_by_demo and "paused-by-demo" not in _read(RECONCILE).tags
    after = _register(tmp_path)
    assert _paused() == {RECONCILE} and after.kept.paused == [RECONCILE]


def test_every_deployment_paused_by_an_older_server_is_kept_and_explained(
    server: PrefectServer, tmp_path: Path
) -> None:
    """What an openlab server before this fix left behind when it stopped: everything paused."""
    _register(tmp_path)
    for name in ALL:
        _pause(name)
    done = _register(tmp_path)
    assert _paused() == set(ALL) and done.kept.every_paused
    lines = done.kept.lines("openlab server")
    assert any("every deployment is paused" in line for line in lines), lines
    assert any("`openlab server --resume`" in line for line in lines), lines
    _register(tmp_path, resume=True)
    assert _paused() == set()


def test_a_schedule_added_in_the_ui_is_kept_beside_openlabs_own(server: PrefectServer, tmp_path: Path) -> None:
    """A person adds a second schedule to the nightly in the UI (a Saturday run with its own
    parameters, no slug, as the UI's form makes it) and one to the pipeline, which openlab schedules
    nothing on: registering again keeps both, as they were, and openlab's own schedule is updated
    beside them. Prefect replaces every schedule of a deployment whose schedules are not all slugged,
    so without carrying it over the next ``openlab server`` start deleted the person's schedule."""
    from prefect import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule

    first = _register(tmp_path)
    assert not first.kept.lines()
    saturday = DeploymentScheduleCreate(
        schedule=CronSchedule(cron="0 9 * * 6", timezone="Europe/Berlin"), active=False, parameters={"force": True}
    )
    weekly = DeploymentScheduleCreate(schedule=CronSchedule(cron="0 3 * * 1", timezone="UTC"), active=True)
    with get_client(sync_client=True) as client:
        client.create_deployment_schedules(_read(NIGHTLY).id, [saturday])
        client.create_deployment_schedules(_read(PIPELINE).id, [weekly])

    again = _register(tmp_path)
    nightly = {s.schedule.cron: s for s in _read(NIGHTLY).schedules}
    assert set(nightly) == {"0 2 * * *", "0 9 * * 6"}, nightly
    added = nightly["0 9 * * 6"]
    assert (added.active, added.parameters, added.schedule.timezone, added.slug) == (
        False,
        {"force": True},
        "Europe/Berlin",
        None,
    ), added
    assert nightly["0 2 * * *"].active and nightly["0 2 * * *"].slug == "nightly"
    assert [s.schedule.cron for s in _read(PIPELINE).schedules] == ["0 3 * * 1"]
    assert (NIGHTLY, "0 9 * * 6 (Europe/Berlin)") in again.kept.added, again.kept
    assert any("added on the Prefect server" in line for line in again.kept.lines()), again.kept.lines()

    # openlab's own schedule edited in the UI goes back to what the settings say, and says so
    ours = next(s for s in _read(NIGHTLY).schedules if s.slug == "nightly")
    with get_client(sync_client=True) as client:
        client.update_deployment_schedule(_read(NIGHTLY).id, ours.id, schedule=CronSchedule(cron="0 3 * * *"))
    reset = _register(tmp_path)
    assert {s.schedule.cron for s in _read(NIGHTLY).schedules} == {"0 2 * * *", "0 9 * * 6"}
    assert reset.kept.moved == [(NIGHTLY, "0 3 * * * (UTC)", "0 2 * * * (UTC)")], reset.kept

    # the cron in the settings moves: openlab's schedule moves, the person's stays
    from flows.deployments import apply_deployments, build_deployments, in_repo_root

    with in_repo_root():
        apply_deployments(build_deployments(_settings(tmp_path, OPENLAB_PREFECT__NIGHTLY_CRON="30 1 * * *")))
    assert {s.schedule.cron for s in _read(NIGHTLY).schedules} == {"30 1 * * *", "0 9 * * 6"}
