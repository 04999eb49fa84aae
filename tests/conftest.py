"""Fixtures shared by every test folder.

Each test gets its own ``OPENLAB_HOME`` (so its own SQLite lineage store, snapshots and
blobs) and never sees the developer's real configuration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# xdist workers sharing two cores each start torch jobs with two OpenMP threads: spinning idle threads
# would take the CPU from the other worker's job (3 tests measured 43 s with spinning, 36 s without).
# Jobs inherit it (local and Slurm); it changes no number a run computes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


#: Tests that share something a worker holds by itself, each run as one unit on one worker
#: (:func:`pytest_xdist_make_scheduler`): the Slurm cluster, which its tests take in turn (see
#: ``_current_test``), and the Prefect servers a worker starts once for all the tests that use one:
#: the session's, with its served runner, whose stages later flow tests reuse (tests/flows/conftest.py),
#: and the one tests/flows/test_deploy_state.py pauses and resumes deployments on (~30 s to start on
#: two busy cores: started on each worker, it cost a minute more).
_UNITS = {"slurm": "the slurm cluster"}
_FIXTURE_UNITS = {
    "prefect_server": "the prefect server",
    "deploy_state_server": "the deploy-state prefect server",
}


def _unit(item: pytest.Item) -> str | None:
    """The unit of ``item``: a server's before the cluster's, since a ``slurm`` test that uses a Prefect
    server elsewhere starts a second one (and its served runner) on the Slurm worker; the cluster's lock
    still keeps it apart from the other ``slurm`` tests."""
    fixtures = getattr(item, "fixturenames", ())
    unit = next((unit for fixture, unit in _FIXTURE_UNITS.items() if fixture in fixtures), None)
    if unit is None and item.get_closest_marker("slurm") is not None:
        return _UNITS["slurm"]
    return unit


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """(xdist controller) Tell each worker where to write the unit of each test it collected."""
    node.workerinput["openlab_units"] = str(_units_file(node.config))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """(xdist worker) Write which unit each test belongs to, for the controller's scheduler."""
    target = getattr(config, "workerinput", {}).get("openlab_units")
    if target:
        units = {item.nodeid: unit for item in items if (unit := _unit(item))}
        Path(f"{target}.{config.workerinput['workerid']}").write_text(json.dumps(units))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Hand each unit of tests to one worker, the largest first, and every other test on its own.

    Handed out with the others, a ``slurm`` test holds its worker idle while another worker's has
    the cluster, and flow tests on two workers start two Prefect servers and run the tiny replica
    twice. As units they run back to back on one worker while the others share the rest.
    """
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "load":  # another distribution asked for by name: that one
        return None

    class UnitScheduling(LoadScopeScheduling):
        units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:  # every worker has collected, and written its list, by now
                first = min(_units_file(self.config).parent.glob(_units_file(self.config).name + ".*"), default=None)
                self.units = json.loads(first.read_text()) if first else {}
            return self.units.get(nodeid, nodeid)

    return UnitScheduling(config, log)


def _units_file(config: pytest.Config) -> Path:
    return config._tmp_path_factory.getbasetemp() / "units"  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _current_test(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Let the service helpers see which test asks for a service (its marks), and give a ``slurm`` test
    the cluster to itself.

    `make test` runs several pytest-xdist workers. The Slurm cluster is one 2-CPU node: a test filling
    it, or preempting from the urgent partition, would starve or cancel another worker's job. The
    scheduler runs the ``slurm`` tests on one worker (:func:`pytest_xdist_make_scheduler`); the lock
    shared by the workers, held while such a test runs, keeps them apart under any other
    distribution (``--dist loadgroup`` would not: pytest 9 names items by ``_id``, and pytest-xdist
    3.8 still renames ``_nodeid``, so its groups do nothing). ``require_slurm`` refuses a test that
    uses the cluster without the mark.
    """
    import fcntl

    from tests import services

    services.current_test = request.node
    lock = None
    if os.environ.get("PYTEST_XDIST_WORKER") and request.node.get_closest_marker("slurm") is not None:
        lock = (tmp_path_factory.getbasetemp().parent / "slurm-cluster.lock").open("a")
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
    try:
        yield
    finally:
        services.current_test = None
        if lock is not None:
            lock.close()


@pytest.fixture(autouse=True)
def openlab_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty OPENLAB_HOME for every test; no project config leaks in."""
    home = tmp_path_factory.mktemp("openlab-home")
    monkeypatch.setenv("OPENLAB_HOME", str(home))
    monkeypatch.delenv("OPENLAB_DB_URL", raising=False)
    monkeypatch.setenv("OPENLAB_CONFIG", str(_empty_config(home)))
    monkeypatch.setenv("DO_NOT_TRACK", "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in list(os.environ):
        if name.startswith("OPENLAB_") and "__" in name:
            monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture(scope="session")
def k8s_cluster() -> Iterator[Any]:
    """The emulated Kubernetes API server and controller (tests/launchers/k8s_emulator.py); pods are
    Docker containers of their image when the engine is up."""
    from tests.launchers.k8s_emulator import EmulatedCluster

    cluster = EmulatedCluster().start()
    yield cluster
    cluster.stop()
    assert not cluster.errors, cluster.errors


def _empty_config(home: Path) -> Path:
    path = home / "openlab.toml"
    path.write_text("# test configuration: defaults only\n")
    return path


@pytest.fixture
def run_cli(openlab_home: Path) -> Iterator[object]:
    """Run ``openlab ARGS`` as a real child process (forked from a template that has the heavy
    imports done: :mod:`tests.forked_cli`); returns the CompletedProcess."""
    from tests.forked_cli import run_cli as forked

    def _run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 300):
        return forked(args, env={**os.environ, **(env or {})}, cwd=cwd or REPO_ROOT, timeout=timeout)

    yield _run


@pytest.fixture
def run_cli_tty(openlab_home: Path) -> Iterator[object]:
    """Run ``openlab ARGS`` in a pseudo-terminal, as a person at a terminal does (rich's live
    displays take that path only); returns (exit code, everything it wrote, escapes stripped).
    ``answer`` is typed at the terminal, as a person answers a question the command asks."""
    import pty
    import re

    def _run(*args: str, timeout: float = 300, answer: str | None = None) -> tuple[int, str]:
        primary, secondary = pty.openpty()
        env = {**os.environ, "COLUMNS": "200", "LINES": "50", "TERM": "xterm-256color"}
        env.pop("NO_COLOR", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli.main", *args],
            stdin=secondary,
            stdout=secondary,
            stderr=secondary,
            env=env,
            cwd=REPO_ROOT,
            close_fds=True,
        )
        os.close(secondary)
        if answer is not None:  # the terminal holds the line until the command reads it
            os.write(primary, (answer + "\n").encode())
        chunks: list[bytes] = []
        while True:
            try:
                data = os.read(primary, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        os.close(primary)
        code = proc.wait(timeout=timeout)
        text = b"".join(chunks).decode(errors="replace")
        return code, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "", text)

    yield _run
