"""The real MoE workload on the ``tiny`` replica through the real Slurm cluster.

Why a whole-pipeline test on Slurm and not only the launcher suite: a stage job runs on
a node with the node's environment, so what the pipeline puts on the command line (the
interpreter, the config path, the artifact root) must work there. A bare ``python``
used to start the node's system Python, without the workload's packages.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.lineage.models import Attempt, StageRun
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline.dag import MOE_CHECKPOINT_STAGES
from orchestrator.recipes import RECIPES_DIR, resolve
from orchestrator.settings import load_settings
from tests.services import require_slurm

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

STAGES = ["data", "tokenize", "pretrain", "midtrain", "posttrain", "eval"]


def test_tiny_replica_runs_end_to_end_on_slurm(tmp_path: Path) -> None:
    require_slurm()
    # The shipped recipe, with pretrain sent to the cluster's other partition as a lab sends
    # training to its GPU partition (`resources.pretrain.slurm.partition`).
    recipe = yaml.safe_load((RECIPES_DIR / "marin-535b-a23b.yaml").read_text())
    recipe["replicas"]["tiny"]["resources"]["pretrain"]["slurm"] = {"partition": "batch"}
    path = tmp_path / "marin-535b-a23b.yaml"
    path.write_text(yaml.safe_dump(recipe))
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.main", "run", str(path), "--replica", "tiny"]
        + ["--backend", "slurm", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["state"] == "COMPLETED"
    assert [s["stage"] for s in result["stages"]] == STAGES
    assert 0.0 <= result["stages"][-1]["metrics"]["eval/moe/drop_fraction"] <= 1.0

    # What the recipe's tiny replica asks for (`resources`), recorded and given by Slurm itself.
    asked = resolve(path, "tiny").resources
    with LineageStore.open(load_settings()) as store:
        for stage in store.list(StageRun):
            attempts = store.list(Attempt, stage_run_id=stage.id)
            assert [a.state for a in attempts] == ["COMPLETED"], (stage.stage, attempts)
            attempt = attempts[0]
            assert attempt.backend == "slurm" and attempt.job_id and attempt.job_id.isdigit()
            assert attempt.host  # the node the job ran on
            assert attempt.command[0] == sys.executable  # the project's interpreter, not the node's `python`
            partition = "batch" if stage.stage == "pretrain" else "debug"  # debug: the cluster's default
            expected = {k: v for k, v in asked[stage.stage].items() if k != "slurm"}
            if stage.stage in MOE_CHECKPOINT_STAGES:  # warned ahead of its limit, to save and stop
                expected["warn_before_limit"] = min(300, expected["time_limit"] // 10)
            assert attempt.resources == {
                **expected,
                **({"options": {"partition": "batch"}} if partition == "batch" else {}),
            }
            shown = subprocess.run(["scontrol", "show", "job", attempt.job_id], capture_output=True, text=True)
            fields = dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)
            assert fields["NumCPUs"] == str(asked[stage.stage]["cpus"]), shown.stdout
            assert fields["MinMemoryNode"] == asked[stage.stage]["memory"], shown.stdout
            assert fields["Partition"] == partition, shown.stdout
            assert fields["TimeLimit"] == f"00:{asked[stage.stage]['time_limit'] // 60:02d}:00", shown.stdout
