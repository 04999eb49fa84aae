"""`make demo`, the README's first promise: the replica pipeline end to end, then where to look, and
the commands it prints work as printed."""

from __future__ import annotations

import contextlib
import json
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

STAGES = ["data", "tokenize", "pretrain", "midtrain", "posttrain", "eval"]


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
        _the_run_is_recorded_as_it_ran(home, run_id)

        # The same replica from a terminal is the same six identities: `openlab run` reuses what the flow made.
        cli_run = run("-m", "orchestrator.cli.main", "run", "marin-535b-a23b", "--replica", "tiny", "--json")
        assert cli_run.returncode == 0, cli_run.stderr[-3000:]
        reused = json.loads(cli_run.stdout)
        # (an edit to workloads/moe between the two runs legitimately re-runs a stage: the reason names it)
        assert [(s["stage"], s["state"]) for s in reused["stages"]] == [(s, "REUSED") for s in STAGES], [
            (s["stage"], s["state"], s["reason"]) for s in reused["stages"]
        ]
        assert reused["recipe_lineage"]["scale"]["d_model"] == "1/96"

        again = run("-m", "orchestrator.cli.main", *printed("run it again"))
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"rerun of {run_id} (COMPLETED): marin-535b-a23b -r tiny on local" in again.stderr, again.stderr
        assert "eval COMPLETED" in again.stderr and "forced; identity" in again.stderr, again.stderr
        shown = run("-m", "orchestrator.cli.main", "lineage", "list", "-k", "pipeline_run")
        assert f"retry of {run_id}" in " ".join(shown.stdout.split()), shown.stdout
        _a_forced_eval_is_a_wandb_run_of_its_own(home, run_id)
    finally:
        if pid_file.exists():  # the server the demo leaves up for the UI
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)


def _the_run_is_recorded_as_it_ran(home: Path, run_id: str) -> None:
    """Six completed stages, eval's drop fraction a fraction, and the recipe's pre-registered eval loss
    checked against what eval measured, provably predicted before it: the run's first event (its
    start) already carries the prediction."""
    from orchestrator.lineage import LineageStore, PipelineRun, StageRun

    with LineageStore(f"sqlite:///{home / 'lineage.db'}") as store:
        pipeline_run = store.require(PipelineRun, run_id)
        stages = {s.stage: s for s in store.list(StageRun, pipeline_run_id=run_id)}
        start = store.events(run_id)[0]
    assert pipeline_run.state == "COMPLETED" and sorted(stages) == sorted(STAGES)
    assert {s.state for s in stages.values()} == {"COMPLETED"}, {k: s.state for k, s in stages.items()}
    metrics = stages["eval"].metrics
    assert 0.0 <= metrics["eval/moe/drop_fraction"] <= 1.0
    (check,) = pipeline_run.preregistration["checks"]
    assert (check["metric"], check["stage"], check["predicted"]) == ("eval/code/loss", "eval", 5.3)
    assert check["actual"] == metrics["eval/code/loss"]
    assert check["outcome"] == ("met" if abs(check["actual"] - 5.3) <= check["tolerance"] else "missed")
    assert start.payload["params"]["recipe"]["preregistered"][0]["value"] == 5.3
    assert start.at < stages["eval"].ended_at


def _a_forced_eval_is_a_wandb_run_of_its_own(home: Path, run_id: str) -> None:
    """Forced again, eval is a W&B run of its own (continuing the first would log its steps over it),
    named for people; the first's offline run, never uploaded, is kept out of the deleted folder."""
    from orchestrator.lineage import LineageStore, PipelineRun, StageRun, WandbRun
    from orchestrator.links.wandb import find_run_dirs, read_run_dir

    with LineageStore(f"sqlite:///{home / 'lineage.db'}") as store:
        (retry,) = [r for r in store.list(PipelineRun) if (r.params or {}).get("retry_of") == run_id]
        runs = {}
        for pipeline_run_id in (run_id, retry.id):
            (srun,) = store.list(StageRun, pipeline_run_id=pipeline_run_id, stage="eval")
            (linked,) = [r.object_id for r in store.relations(srun.id) if r.object_kind == "wandb_run"]
            runs[pipeline_run_id] = store.require(WandbRun, linked)
    before, after = runs[run_id], runs[retry.id]
    assert before.run_id != after.run_id, "a forced re-run continued the completed run's W&B run"
    kept = find_run_dirs(str(Path(str(before.local_dir)).parent), before.run_id)
    assert kept and Path(str(before.local_dir)).parent == home / "wandb-unsynced", before.local_dir
    assert before.mode == "offline" and read_run_dir(kept[0]).summary, "the first run's curves are still there"
    back = read_run_dir(find_run_dirs(str(Path(str(after.local_dir)).parent), after.run_id)[0])
    assert back.name == f"tiny/eval {retry.id}", back.name
