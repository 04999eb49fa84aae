"""The real MoE workload end to end on the ``tiny`` replica (a few minutes on 2 CPU cores)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

STAGES = ["data", "tokenize", "pretrain", "midtrain", "posttrain", "eval"]


def openlab_run(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", "from orchestrator.cli.run import app; app()", "run", "marin-535b-a23b", *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_tiny_replica_runs_end_to_end_then_reuses_everything() -> None:
    first = openlab_run("--replica", "tiny", "--json")
    assert first["state"] == "COMPLETED"
    assert [s["stage"] for s in first["stages"]] == STAGES
    assert all(s["state"] == "COMPLETED" for s in first["stages"])
    metrics = first["stages"][-1]["metrics"]
    assert 0.0 <= metrics["eval/moe/drop_fraction"] <= 1.0
    assert first["recipe_lineage"]["scale"]["d_model"] == "1/96"
    second = openlab_run("--replica", "tiny", "--json")
    # (an edit to workloads/moe between the two runs legitimately re-runs a stage: the reason names it)
    assert [s["state"] for s in second["stages"]] == ["REUSED"] * 6, [
        (s["stage"], s["reason"]) for s in second["stages"]
    ]
