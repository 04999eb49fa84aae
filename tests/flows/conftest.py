"""A real Prefect server for the flow tests, and a real runner serving openlab's deployments.

``prefect_server`` (session): ``prefect server start`` as a subprocess on a free port,
temporary ``PREFECT_HOME``, SQLite, telemetry off, started through
:class:`orchestrator.prefect_server.PrefectServer` — the same code ``openlab server``
runs. Skips with the reason locally when it cannot start; fails under ``CI=true``.

``served`` (session): ``python -m orchestrator.cli.server --api-url ...`` serving the
replica pipeline and the nightly against that server, with its own ``OPENLAB_HOME``
(:attr:`Served.home`), so tests read the lineage the flow runs wrote.

Servers the tests start find their database migrated (:func:`seed_prefect_db`), as a person's
second ``openlab server`` does; ``make demo``'s test keeps the first start's migrations covered.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from orchestrator.prefect_server import PrefectServer, free_port, use_api

REPO_ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


#: Where :func:`seed_prefect_db` keeps the migrated database it copies: the run's temporary folder,
#: shared by its xdist workers (set by :func:`_prefect_db_root`).
_PREFECT_DB_ROOT: Path | None = None


@pytest.fixture(scope="session", autouse=True)
def _prefect_db_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    global _PREFECT_DB_ROOT  # noqa: PLW0603 - one per process, read by a helper that fixtures and tests call
    base = tmp_path_factory.getbasetemp()
    _PREFECT_DB_ROOT = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def seed_prefect_db(prefect_home: Path) -> None:
    """Put a migrated, empty Prefect database where a server in ``prefect_home`` opens its own.

    A server's first start on a new SQLite file runs every Prefect migration: 11 of its 18 s of CPU
    on this machine, for each of the dozen servers the flow tests start. Prefect's own
    ``prefect server database upgrade`` makes one copy per run (under a lock the workers share);
    each server then starts as on a person's second ``openlab server``. A database already there
    is kept.
    """
    target = prefect_home / "prefect.db"
    if target.exists():
        return
    root = _PREFECT_DB_ROOT
    assert root is not None, "seed_prefect_db runs inside a test session"
    template = root / "prefect-db-template" / "prefect.db"
    with (root / "prefect-db-template.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not template.exists():
            scratch = template.parent.with_name(template.parent.name + ".partial")
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            env = {
                **os.environ,
                "PREFECT_HOME": str(scratch),
                "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{scratch / 'prefect.db'}",
                "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{scratch / 'prefect.db'}",
            }
            done = subprocess.run(  # noqa: S603
                [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode != 0:
                unavailable(f"prefect server database upgrade failed:\n{done.stdout}{done.stderr}")
            scratch.rename(template.parent)
    prefect_home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, target)


def unavailable(reason: str) -> None:
    """Skip locally, fail under CI: a missing service must not pass silently there."""
    if IN_CI:
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


def require_service(name: str) -> Any:
    """Call ``tests.services.require_<name>()`` (docker, slurm, ...) from the infra helpers."""
    try:
        import tests.services as services
    except ImportError as exc:
        unavailable(f"tests/services.py is not available ({exc}); cannot check {name}")
    check: Callable[[], Any] | None = getattr(services, f"require_{name}", None)
    if check is None:
        unavailable(f"tests/services.py has no require_{name}()")
    return check()


#: Flow tests that share the served runner's lineage run in this order: the first full tiny
#: run makes the later ones (browser, nightly) reuse every stage instead of re-running it.
_ORDER = ("test_server_cli", "test_served.py::test_replica_deployment", "test_browser_ui", "test_served")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order this folder's tests (others keep their order); correctness never depends on it, time does."""

    def rank(item: pytest.Item) -> int:
        for i, prefix in enumerate(_ORDER):
            if prefix in item.nodeid:
                return i
        return len(_ORDER)

    slots = [i for i, item in enumerate(items) if "tests/flows/" in item.nodeid]
    ordered = sorted((items[i] for i in slots), key=rank)
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item


@contextlib.contextmanager
def running_prefect_server(home: Path) -> Iterator[PrefectServer]:
    """A Prefect server of its own under ``home``, with this process's Prefect client pointed at it
    for the block (``PREFECT_HOME`` too), stopped after it."""
    server = PrefectServer(home=home, port=free_port())
    seed_prefect_db(home)
    try:
        server.start(timeout=120)
    except Exception as exc:  # noqa: BLE001 - any start-up failure is reported the same way
        unavailable(f"cannot start a Prefect server: {exc}")
    saved_home = os.environ.get("PREFECT_HOME")
    os.environ["PREFECT_HOME"] = str(home / "client")
    try:
        # results of flows this process runs go under ``home``: the session's server starts before any
        # test's OPENLAB_HOME, so the default (``$OPENLAB_HOME/prefect/storage``) would be ~/.openlab's
        with use_api(server.api_url, storage=home / "storage"):
            yield server
    finally:
        # Send the log records still queued in this process while the server can take them:
        # otherwise Prefect's log worker posts them to a stopped server at exit and prints
        # "--- Error logging to API ---" under an otherwise green run.
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10, at_exit=False)
        server.stop()
        if saved_home is None:
            os.environ.pop("PREFECT_HOME", None)
        else:
            os.environ["PREFECT_HOME"] = saved_home


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A running Prefect server; this process's Prefect client points at it."""
    with running_prefect_server(tmp_path_factory.mktemp("prefect-home")) as server:
        yield server


@dataclass
class Served:
    """A runner serving openlab's deployments against ``server``; flows write lineage under ``home``."""

    server: PrefectServer
    home: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def db_url(self) -> str:
        return f"sqlite:///{self.home / 'lineage.db'}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def runner_env(server: PrefectServer, home: Path) -> dict[str, str]:
    """Environment of a serving process: this server, this lineage home, quick polling, no telemetry."""
    config = home / "openlab.toml"
    if not config.exists():
        config.write_text("# flow tests: defaults only\n")
    env = {k: v for k, v in os.environ.items() if not (k.startswith("OPENLAB_") and "__" in k)}
    env.update(server.client_env())
    env.update(
        {
            "OPENLAB_HOME": str(home),
            "OPENLAB_CONFIG": str(config),
            "PREFECT_HOME": str(home / "prefect-client"),
            # Served deployments poll for work every 10 s by default; tests need seconds.
            "PREFECT_RUNNER_POLL_FREQUENCY": "1",
            "PYTHONUNBUFFERED": "1",
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
        }
    )
    env.pop("OPENLAB_DB_URL", None)
    for secret in ("GITHUB_TOKEN", "WANDB_API_KEY"):  # served test flows never reach the real services
        env.pop(secret, None)
    # ...but a test may point [github] at the local fake with `token_env = "OPENLAB_TEST_GITHUB_TOKEN"`
    from tests.links.links_fakes import TOKEN

    env["OPENLAB_TEST_GITHUB_TOKEN"] = TOKEN
    try:  # the runner starts before any test calls require_slurm(): hand it the test cluster's config now
        from tests.services import setting

        conf = setting("SLURM_CONF")
        if conf:
            env.setdefault("SLURM_CONF", conf)
            env.pop("SLURM_JWT", None)
    except ImportError:
        pass
    return env


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 40.0) -> int | None:
    """SIGINT (like Ctrl-C), then SIGKILL of the group after ``timeout``; returns the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    return proc.returncode


def wait_for_deployments(names: list[str], timeout: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Poll the API until every deployment ``flow/deployment`` exists, or fail with the runner's log."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout
    missing = list(names)
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                pytest.fail(f"serving process exited with {proc.returncode}:\n{tail}")
            for name in list(missing):
                with contextlib.suppress(ObjectNotFound):
                    client.read_deployment_by_name(name)
                    missing.remove(name)
            if not missing:
                return
            time.sleep(0.5)
    pytest.fail(f"deployments {missing} not registered after {timeout:g}s:\n{log.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="session")
def served(prefect_server: PrefectServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """``openlab server --api-url`` serving both deployments for the whole session."""
    home = tmp_path_factory.mktemp("served-openlab-home")
    log_path = home / "runner.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(  # noqa: S603 - our interpreter, fixed arguments
            [sys.executable, "-m", "orchestrator.cli.server", "--api-url", prefect_server.api_url],
            cwd=REPO_ROOT,
            env=runner_env(prefect_server, home),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for_deployments(
            [
                "replica-pipeline/replica",
                "nightly-replica/nightly",
                "lineage-reconcile/reconcile",
                "replica-sweep/sweep",
            ],
            90,
            proc,
            log_path,
        )
        yield Served(server=prefect_server, home=home, process=proc, log_path=log_path)
    finally:
        try:
            cancel_unfinished_flow_runs(timeout=60)
        finally:
            stop_process(proc)


def cancel_unfinished_flow_runs(timeout: float) -> None:
    """Cancel every flow run in flight (pending or running), through the API, and wait for them to end.

    A test that fails or times out can leave a replica running; stopping the runner would
    kill its flow process, and its Docker or Slurm job would run on (a 30-minute pretrain
    once slowed the next CI run until a browser test timed out). A Prefect cancel runs the
    flows' on-cancellation path, which ends their jobs.
    """
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    unfinished = FlowRunFilter(
        state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING])
        )
    )
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=unfinished)
        for run in runs:
            if run.state is not None and run.state.type is not StateType.CANCELLING:
                with contextlib.suppress(Exception):
                    client.set_flow_run_state(run.id, Cancelling(message="test session ends"), force=True)
        deadline = time.monotonic() + timeout
        for run in runs:
            while time.monotonic() < deadline:
                state = client.read_flow_run(run.id).state
                if state is None or state.is_final():
                    break
                time.sleep(0.5)


def wait_flow_run(flow_run_id: Any, timeout: float, *, final: bool = True) -> Any:
    """Poll a flow run until it reaches a final state (or ``timeout``); returns the flow run."""
    from prefect import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and (run.state.is_final() if final else not run.state.is_scheduled()):
                return run
            if time.monotonic() > deadline:
                pytest.fail(f"flow run {flow_run_id} still {run.state and run.state.name} after {timeout:g}s")
            time.sleep(0.5)


def openlab_events(flow_run_id: Any, wanted: set[str], timeout: float = 30.0) -> dict[str, Any]:
    """The flow run's ``openlab.*`` events by name, once all of ``wanted`` arrived (the server
    stores events a moment after they are sent)."""
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

    related = EventRelatedFilter(id=[f"prefect.flow-run.{flow_run_id}"])
    query = EventFilter(event=EventNameFilter(prefix=["openlab."]), related=related)
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            found = {e.event: e for e in client.read_events(filter=query, limit=50).events}
            if wanted <= set(found) or time.monotonic() > deadline:
                return found
            time.sleep(0.5)


def sweep_runs_and_table(sweep_id: Any, key: str = "sweep") -> tuple[list[Any], str]:
    """A sweep's flow runs (the children it started) and its artifact's markdown: ``sweep``, the
    comparison, or ``sweep-plan``, a dry run's plan."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )

    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[sweep_id]))
        )
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[sweep_id]))
        )
    assert artifact.key == key, artifact.key
    return children, str(artifact.data)


def flow_run_logs(flow_run_id: Any, until: str | Callable[[list[Any]], bool], timeout: float = 30.0) -> list[Any]:
    """The flow run's log records (its task runs' too), oldest first, once one contains ``until`` (or
    ``until(records)`` holds), or ``timeout`` passed: logs reach the server in batches, after the state."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    done = (lambda logs: any(until in log.message for log in logs)) if isinstance(until, str) else until
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            if done(logs) or time.monotonic() > deadline:
                return sorted(logs, key=lambda log: log.timestamp)
            time.sleep(0.5)
