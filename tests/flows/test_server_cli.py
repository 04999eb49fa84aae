"""``openlab server`` and ``openlab deploy`` as a user runs them, against real Prefect servers."""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.prefect_server import PrefectServer, free_port, health_ok
from tests.flows.conftest import REPO_ROOT, runner_env, seed_prefect_db, stop_process, wait_for_deployments

pytestmark = [pytest.mark.prefect]

PIPELINE = "replica-pipeline/replica"
NIGHTLY = "nightly-replica/nightly"
DROPS_NIGHTLY = "nightly-replica/nightly-drops"
RECONCILE = "lineage-reconcile/reconcile"
GC = "outputs-gc/gc"
DIGEST = "github-digest/daily"


def _cli(module: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: S603
        [sys.executable, "-m", f"orchestrator.cli.{module}", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_deploy_registers_parameter_schema_and_nightly_cron(prefect_server: PrefectServer, tmp_path: Path) -> None:
    from prefect import get_client

    env = runner_env(prefect_server, tmp_path)
    done = _cli("deploy", "--api-url", prefect_server.api_url, "--nightly-cron", "30 3 * * *", env=env)
    assert done.returncode == 0, done.stderr
    assert PIPELINE in done.stdout and NIGHTLY in done.stdout and "30 3 * * *" in done.stdout
    with get_client(sync_client=True) as client:
        pipeline = client.read_deployment_by_name(PIPELINE)
        nightly = client.read_deployment_by_name(NIGHTLY)
    props = pipeline.parameter_openapi_schema["properties"]
    assert {"recipe", "replica", "backend", "issue", "git_ref", "force", "dry_run", "until", "overrides"} <= set(props)
    backend = props["backend"]  # empty by default: [backends] default of openlab.toml, as `openlab run`
    assert [b["enum"] for b in backend.get("anyOf", [backend]) if "enum" in b] == [
        ["local", "docker", "slurm", "kubernetes"]
    ], backend
    assert backend.get("default") is None and "[backends] default" in backend["description"], backend
    assert props["force"]["type"] == "boolean" and props["dry_run"]["default"] is False
    assert "description" in props["replica"]  # from the flow's docstring, shown in the UI form
    with get_client(sync_client=True) as client:  # the sweep: a grid or samples to fill in, the example in its text
        sweep = client.read_deployment_by_name("replica-sweep/sweep")
    # no preset grid: one filled in with samples and count ran every draw at each of its values (3 x count)
    assert sweep.parameters == {} and '{"pretrain.lr": [0.005, 0.01]}' in (sweep.description or "")
    sweep_props = sweep.parameter_openapi_schema["properties"]
    assert {
        "grid",
        "recipe",
        "replica",
        "backend",
        "overrides",
        "issue",
        "until",
        "git_ref",
        "at_once",
        "metrics",
    } <= set(sweep_props)
    (schedule,) = nightly.schedules
    assert schedule.schedule.cron == "30 3 * * *" and schedule.schedule.timezone == "UTC"
    assert nightly.parameter_openapi_schema["properties"]["git_ref"]["default"] == "main"
    # the drop-fraction nightly: the same flow on the reproduction replica, on its own schedule
    assert DROPS_NIGHTLY in done.stdout and "drop-fraction nightly schedule: 0 4 * * *" in done.stdout
    with get_client(sync_client=True) as client:
        drops = client.read_deployment_by_name(DROPS_NIGHTLY)
    assert drops.parameters["replica"] == "drops" and drops.flow_id == nightly.flow_id
    (drops_schedule,) = drops.schedules
    assert drops_schedule.schedule.cron == "0 4 * * *" and drops_schedule.schedule.timezone == "UTC"

    # the reaper: registered for the UI, on its 10-minute schedule (the runs of dead orchestrators)
    assert "reconcile schedule: every 600 s" in done.stdout
    with get_client(sync_client=True) as client:
        reaper = client.read_deployment_by_name(RECONCILE)
    (reaper_schedule,) = reaper.schedules
    assert reaper_schedule.schedule.interval == dt.timedelta(seconds=600)
    assert reaper.parameter_openapi_schema["properties"]["dry_run"]["default"] is False

    # the outputs gc: a dry run from the UI, and no schedule until someone chooses one
    # (the config key it names printed as written: rich read `[prefect]` as a style tag and dropped it)
    assert "outputs gc schedule: none (a dry run from the UI; [prefect] gc_cron sets one)" in done.stdout
    with get_client(sync_client=True) as client:
        gc = client.read_deployment_by_name(GC)
    assert gc.schedules == [] and gc.parameter_openapi_schema["properties"]["dry_run"]["default"] is True
    gc_params = gc.parameter_openapi_schema["properties"]
    assert {"keep", "unused_for", "stages", "recipe", "replica"} <= gc_params.keys()
    assert {"include_failed", "failed_unused_for"} <= gc_params.keys()
    assert gc_params["include_failed"]["default"] is False, "failed runs' checkpoints stay unless asked"

    # the daily digest on experiment issues: 07:00 UTC unless [prefect] digest_cron says otherwise
    assert "github digest schedule: 0 7 * * * (UTC)" in done.stdout
    with get_client(sync_client=True) as client:
        digest = client.read_deployment_by_name(DIGEST)
    (digest_schedule,) = digest.schedules
    assert digest_schedule.schedule.cron == "0 7 * * *" and digest_schedule.schedule.timezone == "UTC"
    assert {"since", "issues", "dry_run"} <= digest.parameter_openapi_schema["properties"].keys()
    # one at a time, like the nightlies: a run due while the last still goes is cancelled, not queued
    assert digest.global_concurrency_limit is not None and digest.global_concurrency_limit.limit == 1
    assert digest.concurrency_options.collision_strategy == "CANCEL_NEW"

    # Registering again updates in place; the default cron is 02:00 UTC; [prefect] gc_cron schedules
    # the gc, and the schedule's runs delete (the deployment's default stays a dry run); an empty
    # [prefect] digest_cron keeps the digest registered for the UI, with no schedule
    schedules = {"OPENLAB_PREFECT__GC_CRON": "0 6 * * 0", "OPENLAB_PREFECT__DIGEST_CRON": ""}
    again = _cli("deploy", "--api-url", prefect_server.api_url, env={**env, **schedules})
    assert again.returncode == 0, again.stderr
    assert "outputs gc schedule: 0 6 * * 0 (UTC)" in again.stdout
    assert "github digest schedule: none (run it from the UI or `openlab github digest`; [prefect] digest_cron" in (
        again.stdout
    )
    with get_client(sync_client=True) as client:
        (schedule,) = client.read_deployment_by_name(NIGHTLY).schedules
        assert client.read_deployment_by_name(PIPELINE).id == pipeline.id
        gc = client.read_deployment_by_name(GC)
    assert schedule.schedule.cron == "0 2 * * *"
    (gc_schedule,) = gc.schedules
    assert gc_schedule.schedule.cron == "0 6 * * 0" and gc_schedule.parameters == {"dry_run": False}
    assert gc.parameters.get("dry_run", True) is True
    with get_client(sync_client=True) as client:
        assert client.read_deployment_by_name(DIGEST).schedules == []


def test_deploy_errors_are_one_clear_line(prefect_server: PrefectServer, tmp_path: Path) -> None:
    env = runner_env(prefect_server, tmp_path)
    bad_cron = _cli("deploy", "--api-url", prefect_server.api_url, "--nightly-cron", "every night", env=env)
    assert bad_cron.returncode == 2 and "invalid nightly cron 'every night'" in bad_cron.stderr
    assert "Traceback" not in bad_cron.stderr
    (tmp_path / "openlab.toml").write_text("[prefect]\nreconcile_every_s = 5\n")
    too_often = _cli("deploy", "--api-url", prefect_server.api_url, env=env)
    assert too_often.returncode == 2 and "Traceback" not in too_often.stderr
    assert too_often.stderr.strip() == (
        "error: invalid [prefect] reconcile_every_s 5: use seconds, at least 60 (e.g. 600), or 0 for no schedule"
    )
    (tmp_path / "openlab.toml").write_text("")
    bad_gc = _cli("deploy", "--api-url", prefect_server.api_url, env={**env, "OPENLAB_PREFECT__GC_CRON": "weekly"})
    assert bad_gc.returncode == 2 and "Traceback" not in bad_gc.stderr
    assert "error: invalid cron 'weekly' ([prefect] gc_cron)" in bad_gc.stderr, bad_gc.stderr
    bad_digest = _cli(
        "deploy", "--api-url", prefect_server.api_url, env={**env, "OPENLAB_PREFECT__DIGEST_CRON": "daily"}
    )
    assert bad_digest.returncode == 2 and "Traceback" not in bad_digest.stderr
    assert "error: invalid cron 'daily' ([prefect] digest_cron)" in bad_digest.stderr, bad_digest.stderr
    nobody = f"http://127.0.0.1:{free_port()}/api"
    down = _cli("deploy", "--api-url", nobody, env=env)
    assert down.returncode == 2 and "openlab server" in down.stderr and "Traceback" not in down.stderr


@pytest.mark.slow
def test_openlab_server_starts_serves_and_stops_on_ctrl_c(prefect_server: PrefectServer, tmp_path: Path) -> None:
    """Own SQLite server under $OPENLAB_HOME/prefect, telemetry off, both deployments served, Ctrl-C stops all."""
    port = free_port()
    env = runner_env(prefect_server, tmp_path)
    env.pop("PREFECT_API_URL")
    log_path = tmp_path / "server-cli.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(  # noqa: S603
            [sys.executable, "-m", "orchestrator.cli.server", "--port", str(port)],
            cwd=tmp_path,  # entrypoints must resolve wherever openlab is started
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 120
        while not health_ok(api):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        from orchestrator.prefect_server import use_api

        with use_api(api):
            wait_for_deployments([PIPELINE, NIGHTLY], 90, proc, log_path)
        text = log_path.read_text()
        assert f"Prefect UI: http://127.0.0.1:{port}" in text
        assert (tmp_path / "prefect" / "prefect.db").exists(), "SQLite under $OPENLAB_HOME/prefect"
        server_pids = _children(proc.pid)
        assert server_pids, "the Prefect server runs as a child process"
    finally:
        code = stop_process(proc, timeout=45)
    assert code == 0, log_path.read_text()[-2000:]
    assert not health_ok(api), "the Prefect server stopped with openlab server"
    for pid in server_pids:
        assert not _alive(pid), f"process {pid} survived Ctrl-C"
    assert "stopped" in log_path.read_text()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False


def test_a_server_on_every_interface_tells_its_ui_to_ask_this_machine_not_0000(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`openlab server --host 0.0.0.0` is for browsers on other machines; Prefect's UI told them to
    ask http://0.0.0.0:4200/api, their own machine, and showed nothing."""
    import socket

    monkeypatch.delenv("PREFECT_UI_API_URL", raising=False)
    server = PrefectServer(home=tmp_path, host="0.0.0.0", port=4301)
    assert server.env()["PREFECT_UI_API_URL"] == f"http://{socket.getfqdn()}:4301/api"
    assert "PREFECT_UI_API_URL" not in PrefectServer(home=tmp_path, port=4301).env(), "127.0.0.1: Prefect's own"
    monkeypatch.setenv("PREFECT_UI_API_URL", "https://prefect.lab.example/api")  # behind a proxy: as given
    assert server.env()["PREFECT_UI_API_URL"] == "https://prefect.lab.example/api"


def test_a_server_on_an_ipv6_address_starts_and_every_url_it_gives_works(tmp_path: Path) -> None:
    """`openlab server --host ::1` raised "Address family for hostname not supported" out of its port check
    (an IPv4 socket), and the URLs it printed, http://::1:4200, and the one Prefect gave its UI, parse
    in no browser or client."""
    import socket

    from orchestrator.prefect_server import PrefectServerError, port_in_use

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:  # a machine without IPv6 loopback: nothing to test
        pytest.skip(f"this machine has no IPv6 loopback ({exc})")
    port = free_port("::1")
    assert PrefectServer(home=tmp_path, host="[::1]", port=port).host == "::1", "as a URL writes it, or bare"
    assert PrefectServer(home=tmp_path, host="::", port=port).url == f"http://[::1]:{port}", "every interface: here"
    seed_prefect_db(tmp_path / "prefect")
    with PrefectServer(home=tmp_path / "prefect", host="::1", port=port).start(timeout=120) as server:
        assert server.api_url == f"http://[::1]:{port}/api"
        assert server.env()["PREFECT_UI_API_URL"] == server.api_url, "Prefect's own would be http://::1:PORT/api"
        assert health_ok(server.api_url) and port_in_use("::1", port)
        with pytest.raises(PrefectServerError, match=f"port {port} is already in use"):
            PrefectServer(home=tmp_path / "other", host="::1", port=port).start()
    assert not port_in_use("::1", port), "stopped"


def test_prefect_database_and_cron_come_from_openlab_settings(tmp_path: Path) -> None:
    """SQLite under $OPENLAB_HOME/prefect by default; [prefect] database_url switches to PostgreSQL (asyncpg)."""
    from flows.deployments import nightly_cron
    from orchestrator.errors import ConfigError
    from orchestrator.settings import load_settings

    env = {"OPENLAB_HOME": str(tmp_path), "OPENLAB_CONFIG": str(tmp_path / "none.toml")}
    (tmp_path / "none.toml").write_text("")
    server = PrefectServer.from_settings(load_settings(environ=env))
    assert server.database_url == f"sqlite+aiosqlite:///{tmp_path / 'prefect' / 'prefect.db'}"
    assert server.env()["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false" and server.env()["DO_NOT_TRACK"] == "1"
    assert "PREFECT_API_URL" not in server.env()
    pg = load_settings(
        environ={**env, "OPENLAB_PREFECT__DATABASE_URL": "postgresql://u:p@db/prefect", "OPENLAB_PREFECT__PORT": "4300"}
    )
    server = PrefectServer.from_settings(pg)
    assert server.database_url == "postgresql+asyncpg://u:p@db/prefect" and server.port == 4300
    # port 0 was taken as unset (4200), `true` as port 1, 4200.9 as 4200
    for given, where in ((0, "--port 0"), ("true", "[prefect] port True"), ("4200.9", "[prefect] port 4200.9")):
        with pytest.raises(ConfigError, match=re.escape(f"{where}: a port is a whole number from 1 to 65535")):
            if isinstance(given, int):
                PrefectServer.from_settings(load_settings(environ=env), port=given)
            else:
                PrefectServer.from_settings(load_settings(environ={**env, "OPENLAB_PREFECT__PORT": given}))
    assert nightly_cron(load_settings(environ=env)) == "0 2 * * *"
    assert nightly_cron(load_settings(environ={**env, "OPENLAB_PREFECT__NIGHTLY_CRON": "15 4 * * 1"})) == "15 4 * * 1"
    with pytest.raises(ConfigError, match="invalid nightly cron"):
        nightly_cron(load_settings(environ=env), "99 99 * * *")
    drops = {"key": "nightly_drops_cron", "default": "0 4 * * *"}
    assert nightly_cron(load_settings(environ=env), **drops) == "0 4 * * *"
    set_drops = {**env, "OPENLAB_PREFECT__NIGHTLY_DROPS_CRON": "30 5 * * *"}
    assert nightly_cron(load_settings(environ=set_drops), **drops) == "30 5 * * *"
    with pytest.raises(ConfigError, match=r"invalid nightly cron 'weekly' \(\[prefect\] nightly_drops_cron\)"):
        nightly_cron(load_settings(environ={**env, "OPENLAB_PREFECT__NIGHTLY_DROPS_CRON": "weekly"}), **drops)
    # a sixth field is seconds to Prefect (60 runs in the minute after 02:00); February 31 never comes
    with pytest.raises(ConfigError, match=r"'0 2 \* \* \* \*' \(\[prefect\] nightly_cron\): use five fields"):
        nightly_cron(load_settings(environ=env), "0 2 * * * *")
    with pytest.raises(ConfigError, match="no date within a year matches it"):
        nightly_cron(load_settings(environ=env), "0 2 31 2 *")
    assert nightly_cron(load_settings(environ=env), "@daily") == "@daily"


def test_a_prefect_database_of_the_users_shell_is_not_the_one_openlab_server_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PREFECT_SERVER_DATABASE_CONNECTION_URL` (Prefect 3's name) exported for a team server outranked
    the older alias openlab set: `openlab server` migrated and wrote the team's database, while its
    banner named its own SQLite file. Prefect itself, given the server's environment, says which it uses."""
    from orchestrator.settings import load_settings

    monkeypatch.setenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", "postgresql+asyncpg://me:pw@teamdb/prefect")
    env = {"OPENLAB_HOME": str(tmp_path), "OPENLAB_CONFIG": str(tmp_path / "none.toml")}
    (tmp_path / "none.toml").write_text("")
    server = PrefectServer.from_settings(load_settings(environ=env))
    read = (
        "from prefect.settings import get_current_settings as s; "
        "print(s().server.database.connection_url.get_secret_value())"
    )
    used = subprocess.run([sys.executable, "-c", read], env=server.env(), capture_output=True, text=True, check=True)
    assert used.stdout.strip() == server.database_url == f"sqlite+aiosqlite:///{tmp_path / 'prefect' / 'prefect.db'}"


def test_the_reapers_passes_keep_their_times_across_server_starts(tmp_path: Path) -> None:
    """`openlab server` registers its deployments at each start. Prefect anchors an interval where it is
    built, so each restart moved the reaper's next pass a whole interval on (a server restarted more
    often than every 10 minutes never reaped) and changed the registered schedule; now its passes fall
    on fixed times of the day, the same for every registration."""
    from flows.deployments import RECONCILE_DEPLOYMENT, build_deployments, in_repo_root
    from orchestrator.settings import load_settings

    (tmp_path / "none.toml").write_text("")
    env = {"OPENLAB_HOME": str(tmp_path), "OPENLAB_CONFIG": str(tmp_path / "none.toml")}

    def reaper_schedule(**extra: str) -> Any:
        with in_repo_root():
            (reaper,) = [
                d for d in build_deployments(load_settings(environ={**env, **extra})) if d.name == RECONCILE_DEPLOYMENT
            ]
        (schedule,) = reaper.schedules
        return schedule.schedule

    first = reaper_schedule()
    time.sleep(0.01)
    again = reaper_schedule()
    assert first.anchor_date == again.anchor_date and first.interval == again.interval
    anchor = first.anchor_date
    assert (anchor.hour, anchor.minute, anchor.second, anchor.microsecond) == (0, 0, 0, 0), anchor
    assert reaper_schedule(OPENLAB_PREFECT__RECONCILE_EVERY_S="900").anchor_date == anchor
