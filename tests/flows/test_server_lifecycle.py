"""``openlab server`` ended the ways a terminal session ends it (SIGHUP, SIGKILL), ``openlab deploy`` to a
work pool that is not there, and where served flow runs keep their results: real servers, real signals."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.prefect_server import PrefectServer, free_port, health_ok, use_api
from tests.flows.conftest import REPO_ROOT, runner_env, seed_prefect_db, stop_process, wait_for_deployments

pytestmark = [pytest.mark.prefect]

PIPELINE = "replica-pipeline/replica"


def _env(home: Path, port: int) -> dict[str, str]:
    """A person's environment for ``openlab server --port port`` with ``$OPENLAB_HOME`` at ``home``,
    whose Prefect database a server has migrated before (:func:`seed_prefect_db`)."""
    seed_prefect_db(home / "prefect")
    env = runner_env(PrefectServer(home=home / "prefect", port=port), home)
    env.pop("PREFECT_API_URL")
    return env


@contextlib.contextmanager
def _openlab_server(home: Path, port: int, *args: str, name: str = "server") -> Iterator[subprocess.Popen[bytes]]:
    """``openlab server --port port [args]`` started in its own session (as a terminal's job), healthy
    when the block starts; Ctrl-C'd (SIGKILL as a last resort) after it if still running."""
    log_path = home / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(  # noqa: S603
            [sys.executable, "-m", "orchestrator.cli.server", "--port", str(port), *args],
            cwd=home,
            env=_env(home, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        # its own server: the UI line comes after the start (a server left on the port answers before)
        while "Prefect UI:" not in log_path.read_text() or not health_ok(f"http://127.0.0.1:{port}/api"):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.3)
        yield proc
    finally:
        stop_process(proc, timeout=45)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout  # noqa: S607
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _alive(pid)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


# -- SIGHUP ------------------------------------------------------------------------------------------


def _running_job(home: Path, flow_run_id: Any, timeout: float = 240) -> Any:
    """The flow run's first attempt whose local job is alive (the run is mid-stage), from its lineage."""
    from orchestrator.launchers import JobHandle, get_launcher
    from orchestrator.lineage import Attempt, LineageStore, PipelineRun, StageRun
    from orchestrator.settings import load_settings

    launcher = get_launcher("local", load_settings(environ={"OPENLAB_HOME": str(home)}))
    deadline = time.monotonic() + timeout
    with LineageStore(f"sqlite:///{home / 'lineage.db'}") as store:
        while time.monotonic() < deadline:
            for run in store.list(PipelineRun, flow_run_id=str(flow_run_id)):
                for stage in store.list(StageRun, pipeline_run_id=run.id):
                    for attempt in store.list(Attempt, stage_run_id=stage.id, state="RUNNING"):
                        if attempt.job_id and not launcher.status(JobHandle("local", attempt.job_id)).state.terminal:
                            return attempt
            time.sleep(0.3)
    pytest.fail(f"no stage job of flow run {flow_run_id} ran within {timeout:g}s:\n{(home / 'server.log').read_text()}")


@pytest.mark.slow
def test_a_hangup_stops_openlab_server_as_sigterm_does(tmp_path: Path) -> None:
    """The terminal closed or the ssh connection dropped (SIGHUP): the in-flight run is cancelled, its job
    ended and recorded CANCELLED, and the Prefect server stopped, as with SIGTERM. Before, SIGHUP killed
    `openlab server` alone: the Prefect server and the flow run went on, and the next start found the
    port taken."""
    from prefect.deployments import run_deployment

    from orchestrator.launchers import JobHandle, get_launcher
    from orchestrator.lineage import Attempt, LineageStore, PipelineRun
    from orchestrator.settings import load_settings

    sig = signal.SIGHUP  # it goes the SIGTERM way, whose handler cancels the in-flight runs
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    with _openlab_server(tmp_path, port) as proc:
        with use_api(api):
            wait_for_deployments([PIPELINE], 90, proc, tmp_path / "server.log")
            # `small`: its stages run long enough to be caught mid-job
            params = {"recipe": "marin-535b-a23b", "replica": "small", "backend": "local"}
            flow_run_id = run_deployment(PIPELINE, parameters=params, timeout=0).id
        try:
            attempt = _running_job(tmp_path, flow_run_id)
        finally:
            servers = _children(proc.pid)
            proc.send_signal(sig)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            code = None
    log = (tmp_path / "server.log").read_text()
    assert code == 0, f"openlab server did not stop cleanly on {sig.name}:\n{log[-3000:]}"
    assert "stopped" in log and not health_ok(api), "the Prefect server stopped with openlab server"
    for pid in servers:
        assert _gone_within(pid, 10), f"process {pid} (the Prefect server, a flow run) survived {sig.name}"
    launcher = get_launcher("local", load_settings(environ={"OPENLAB_HOME": str(tmp_path)}))
    assert launcher.status(JobHandle("local", attempt.job_id)).state.terminal, "the stage's job runs on"
    with LineageStore(f"sqlite:///{tmp_path / 'lineage.db'}") as store:
        assert store.require(Attempt, attempt.id).state == "CANCELLED"
        (run,) = store.list(PipelineRun, flow_run_id=str(flow_run_id))
        assert run.state == "CANCELLED", (run.state, run.error)


def test_nohup_openlab_server_outlives_the_terminal(tmp_path: Path) -> None:
    """`nohup openlab server &`: SIGHUP was ignored on purpose, and stays ignored."""
    port = free_port()
    log_path = tmp_path / "nohup.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(  # noqa: S603
            ["nohup", sys.executable, "-m", "orchestrator.cli.server", "--port", str(port), "--no-serve"],  # noqa: S607
            cwd=tmp_path,
            env=_env(tmp_path, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while not health_ok(f"http://127.0.0.1:{port}/api"):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.3)
        proc.send_signal(signal.SIGHUP)
        time.sleep(2)
        assert proc.poll() is None and health_ok(f"http://127.0.0.1:{port}/api"), log_path.read_text()
    finally:
        assert stop_process(proc, timeout=45) == 0, log_path.read_text()


# -- SIGKILL -----------------------------------------------------------------------------------------


def test_a_sigkilled_openlab_server_takes_its_prefect_server_along(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer, `kill -9`) cannot be handled: Linux ends the Prefect server with its parent,
    and the next `openlab server` on the same port starts. Before, the server ran on, orphaned, and the
    next start said the port was in use."""
    port = free_port()
    with _openlab_server(tmp_path, port, "--no-serve") as first:
        (server,) = _children(first.pid)
        first.kill()
        first.wait(10)
        try:
            assert _gone_within(server, 30), "the Prefect server outlived the openlab server that was SIGKILLed"
        finally:
            _kill(server)
    with _openlab_server(tmp_path, port, "--no-serve", name="again") as again:
        assert stop_process(again, timeout=45) == 0, (tmp_path / "again.log").read_text()
    assert "already in use" not in (tmp_path / "again.log").read_text()


#: An owner whose Prefect server does not die with it (as one started before the parent-death signal,
#: or one that ignored it): starts the server the way `openlab server` does, then waits to be killed.
LEFT_BEHIND = """
import sys, time
from pathlib import Path
from orchestrator.prefect_server import PrefectServer

class WithoutParentDeathSignal(PrefectServer):
    def command(self):
        cmd = super().command()
        return cmd[cmd.index("-m") - 1 :]  # `python -m prefect server start ...` without the wrapper

server = WithoutParentDeathSignal(home=Path(sys.argv[1]), port=int(sys.argv[2]), stop_with_parent=True).start()
print(server.process.pid, flush=True)
time.sleep(600)
"""


def test_the_next_openlab_server_stops_the_prefect_server_a_killed_one_left_and_nothing_else(tmp_path: Path) -> None:
    """What listens on the port is the Prefect server an `openlab server` of this OPENLAB_HOME left when
    it was SIGKILLed: the next one says so in one line, stops it and starts its own. While its owner
    lives it is not a leftover, and a port held by anything else keeps the clear error; neither is
    touched."""
    port = free_port()
    owner = subprocess.Popen(  # noqa: S603
        [sys.executable, "-c", LEFT_BEHIND, str(tmp_path / "prefect"), str(port)],
        cwd=REPO_ROOT,
        env=_env(tmp_path, port),
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert owner.stdout is not None
    server = int(owner.stdout.readline() or 0)
    busy = socket.socket()
    try:
        assert server and health_ok(f"http://127.0.0.1:{port}/api"), "the owner's Prefect server did not start"
        cli = [sys.executable, "-m", "orchestrator.cli.server", "--no-serve", "--port"]
        live = subprocess.run([*cli, str(port)], env=_env(tmp_path, port), capture_output=True, text=True, timeout=60)  # noqa: S603
        assert live.returncode == 2 and f"port {port} is already in use" in live.stderr, live.stderr
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        other = busy.getsockname()[1]
        held = subprocess.run([*cli, str(other)], env=_env(tmp_path, other), capture_output=True, text=True, timeout=60)  # noqa: S603
        assert held.returncode == 2 and "Traceback" not in held.stderr, held.stderr
        assert f"port {other} is already in use: stop what listens there, or pick another with --port" in held.stderr
        # one line: it said "starting", "stopping" and "stopped" of a server it never started
        assert len(held.stderr.strip().splitlines()) == 1, held.stderr
        assert _alive(server), "a Prefect server whose openlab server lives was stopped"

        owner.kill()  # SIGKILL: its server is left behind
        owner.wait(10)
        assert not _gone_within(server, 3) and health_ok(f"http://127.0.0.1:{port}/api")

        with _openlab_server(tmp_path, port, "--no-serve", name="next") as proc:
            assert not _alive(server), "the left-behind Prefect server still runs"
            assert stop_process(proc, timeout=45) == 0
        log = (tmp_path / "next.log").read_text()
        said = [line for line in log.splitlines() if f"pid {server}" in line]
        assert said == [
            f"stopped the Prefect server (pid {server}, port {port}) that an earlier `openlab server` for "
            f"{tmp_path} left running when it was killed; starting a new one"
        ], log
    finally:
        busy.close()
        owner.kill()
        owner.wait(10)
        if server:
            _kill(server)


# -- openlab deploy --work-pool ----------------------------------------------------------------------


def test_deploy_to_a_work_pool_that_does_not_exist_is_one_line_and_registers_nothing(
    prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """Prefect's server answers a deployment for a missing pool with a 500; the person got a 54-line
    traceback and whatever was registered before it."""
    from prefect import get_client

    def registered() -> set[tuple[str, Any]]:
        with get_client(sync_client=True) as client:
            return {(d.name, d.updated) for d in client.read_deployments()}

    before = registered()
    done = subprocess.run(  # noqa: S603
        [sys.executable, "-m", "orchestrator.cli.deploy", "--api-url", prefect_server.api_url, "--work-pool", "gpu q"],
        cwd=REPO_ROOT,
        env=runner_env(prefect_server, tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr.strip()) == (
        2,
        f"error: work pool 'gpu q' does not exist on {prefect_server.api_url}: create it "
        "(prefect work-pool create 'gpu q' --type process) or leave --work-pool out",
    ), done.stderr
    assert registered() == before, "deployments were registered or changed before the refusal"


# -- result storage ----------------------------------------------------------------------------------


#: A flow whose task fails with its result persisted (as a retried, cached or persisting run's is), run the
#: way `openlab server`'s runner and `make demo` run flows: inside `use_api`, in a process of its own
#: (Prefect reads its settings once, at import).
FAILING_FLOW = """
import sys
from prefect import flow, task
from orchestrator.prefect_server import use_api

@task(persist_result=True)
def stage():
    raise RuntimeError("stage failed")

@flow(persist_result=True)
def pipeline():
    return stage()

with use_api(sys.argv[1]):
    state = pipeline(return_state=True)
print(state.type.value)
"""


def test_flow_results_stay_under_openlab_home(prefect_server: PrefectServer, tmp_path: Path) -> None:
    """A failed run's result (a pickled StageFailed, seen) went to $PREFECT_HOME/storage, ~/.prefect/storage
    on a person's machine, outside $OPENLAB_HOME, and piled up there (a test's temporary home did not
    keep it either); a path the user chose is kept."""
    env = runner_env(prefect_server, tmp_path)  # PREFECT_HOME: tmp_path/prefect-client, a person's ~/.prefect
    env.pop("PREFECT_LOCAL_STORAGE_PATH", None)  # this process's, from the session server's use_api: not a person's
    prefects = tmp_path / "prefect-client" / "storage"
    ours = tmp_path / "prefect" / "storage"
    chosen = tmp_path / "chosen"
    for extra, where in (({}, ours), ({"PREFECT_LOCAL_STORAGE_PATH": str(chosen)}, chosen)):
        done = subprocess.run(  # noqa: S603
            [sys.executable, "-c", FAILING_FLOW, prefect_server.api_url],
            cwd=REPO_ROOT,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0 and done.stdout.split()[-1:] == ["FAILED"], done.stdout + done.stderr
        assert not prefects.exists() or not any(prefects.iterdir()), sorted(prefects.iterdir())
        assert where.is_dir() and any(where.iterdir()), f"no result under {where}: {sorted(tmp_path.rglob('*'))}"
