"""`make demo`, the README's first promise: the replica pipeline end to end, then where to look, and
the commands it prints work as printed."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.prefect_server import free_port
from tests.flows.conftest import REPO_ROOT

pytestmark = [pytest.mark.prefect]


def test_the_demo_runs_the_replica_and_every_command_it_prints_for_the_run_works(tmp_path: Path) -> None:
    """The demo on a fresh home (and a port of its own): six stages completed, the pre-registered
    loss judged, then "where to look". Its anchor verifies and its "run it again" reruns eval as the
    run's retry. The server it leaves up for the UI is the one it says to kill."""
    home = tmp_path / "home"
    config = tmp_path / "openlab.toml"
    config.write_text(f"[prefect]\nport = {free_port()}\n")
    env = {k: v for k, v in os.environ.items() if not (k.startswith("OPENLAB_") and "__" in k)}
    env.pop("OPENLAB_DB_URL", None)
    env.pop("PREFECT_API_URL", None)
    env |= {"OPENLAB_HOME": str(home), "OPENLAB_CONFIG": str(config), "PREFECT_HOME": str(tmp_path / "prefect")}
    env |= {"COLUMNS": "250", "WANDB_MODE": "offline", "DO_NOT_TRACK": "1"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(  # noqa: S603
            [sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
        )

    demo = run("-m", "orchestrator.demo")
    pid_file = home / "prefect" / "server.pid"
    try:
        out = demo.stdout
        assert demo.returncode == 0, f"{out[-3000:]}\n{demo.stderr[-3000:]}"
        assert "pre-registered eval/code/loss (eval): predicted 5.3 ± 0.4" in out + demo.stderr, out[-3000:]
        where = {line[:22].strip(): line[22:].strip() for line in out.split("where to look", 1)[1].splitlines()}
        (run_id,) = re.findall(r"openlab lineage show (prun_\w+)", where["this run's lineage"])
        assert where["lineage store"] == f"sqlite:///{home}/lineage.db"
        assert where["stop the server"].split()[1] == pid_file.read_text().strip()

        def printed(label: str) -> list[str]:  # the command on a line, without the note in brackets after it
            return where[label].split("  (")[0].split()[1:]

        verified = run("-m", "orchestrator.cli.main", *printed("not rewritten since"))
        assert verified.returncode == 0 and "lineage verified" in verified.stdout, verified.stdout + verified.stderr
        again = run("-m", "orchestrator.cli.main", *printed("run it again"))
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"rerun of {run_id} (COMPLETED): marin-535b-a23b -r tiny on local" in again.stderr, again.stderr
        assert "eval COMPLETED" in again.stderr and "forced; identity" in again.stderr, again.stderr
        shown = run("-m", "orchestrator.cli.main", "lineage", "list", "-k", "pipeline_run")
        assert f"retry of {run_id}" in " ".join(shown.stdout.split()), shown.stdout
    finally:
        if pid_file.exists():  # the server the demo leaves up for the UI
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
