"""A training stage as a multi-task Slurm job, through the pipeline: the recipe asks for
``tasks_per_node: 2``, pretrain trains data-parallel under srun on the real cluster, and the next
stage trains on from the one checkpoint it wrote."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.lineage import Attempt, LineageStore, StageRun
from orchestrator.pipeline import RunOptions, explain_recipe, run_recipe
from orchestrator.recipes import resolve
from orchestrator.settings import load_settings
from tests.services import require_slurm

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def _two_tasks(until: str = "midtrain") -> object:
    resolved = resolve("marin-535b-a23b", "tiny").until(until)
    resources = {k: dict(v) for k, v in resolved.resources.items()}
    resources["pretrain"] = {**resources.get("pretrain", {}), "tasks_per_node": 2, "cpus": 1, "backend": "slurm"}
    return replace(resolved, resources=resources)


def test_pretrain_trains_over_two_slurm_tasks_and_midtrain_continues_from_it() -> None:
    require_slurm()
    resolved = _two_tasks()
    result = run_recipe(resolved, options=RunOptions(backend="local"))
    assert result.state == "COMPLETED", result.error
    settings = load_settings()
    with LineageStore.open(settings) as store:
        (pretrain,) = store.list(StageRun, pipeline_run_id=result.pipeline_run.id, stage="pretrain")
        (attempt,) = store.list(Attempt, stage_run_id=pretrain.id)
        assert attempt.backend == "slurm" and attempt.resources is not None
        assert (attempt.resources["nodes"], attempt.resources["tasks_per_node"]) == (1, 2)
        assert pretrain.metrics["tasks"] == 2
    log = Path(attempt.log_path or "").read_text()
    assert "0: step 20/20 (100%)" in log, log[-2000:]  # srun --label: the task's rank before each line
    assert [line for line in log.splitlines() if line.startswith("1: ")] == [], "task 1 writes nothing of its own"
    out = Path(result.results["pretrain"].out_dir)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 10, "each step logged once"
    assert result.results["midtrain"].state == "COMPLETED"

    # how many tasks trained is part of the result: the same replica in one process is another pretrain
    single = {p.stage: p for p in explain_recipe(resolve("marin-535b-a23b", "tiny").until("midtrain"))}
    assert (single["tokenize"].action, single["pretrain"].action) == ("reuse", "run")
    assert any(c.startswith("config.tasks") for c in single["pretrain"].changes), single["pretrain"].changes


def test_a_stage_its_backend_cannot_run_is_refused_before_anything_is_recorded() -> None:
    resolved = _two_tasks("pretrain")
    resources = {k: dict(v) for k, v in resolved.resources.items()}
    resources["pretrain"].pop("backend")
    resources["pretrain"]["nodes"] = 2
    with pytest.raises(ConfigError, match="stage pretrain: the local backend runs a job on one machine"):
        run_recipe(replace(resolved, resources=resources), options=RunOptions(backend="local"))
    with LineageStore.open(load_settings()) as store:
        assert store.list(StageRun) == []
