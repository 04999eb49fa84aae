"""A training stage as a several-node Kubernetes job, through the pipeline: the recipe asks for
``nodes: 2`` on kubernetes, and pretrain trains data-parallel in the two pods of an indexed Job (the
emulated cluster: pods are containers of the job image, named by a headless Service), reading the
tokens the local stages wrote and writing one checkpoint, with the lineage saying where it ran."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from orchestrator.lineage import Attempt, LineageStore, PipelineRun, StageRun
from orchestrator.pipeline import RunOptions, run_recipe
from orchestrator.recipes import resolve
from orchestrator.settings import load_settings
from tests.services import require_docker

pytestmark = [pytest.mark.slow, pytest.mark.docker]


def test_pretrain_trains_over_the_two_pods_of_an_indexed_job(k8s_cluster: Any, openlab_home: Path) -> None:
    require_docker()
    assert k8s_cluster.runtime == "docker", k8s_cluster.runtime_reason
    (openlab_home / "openlab.toml").write_text(f'[backends.kubernetes]\nhost = "{k8s_cluster.url}"\n')
    resolved = resolve("marin-535b-a23b", "tiny").until("pretrain")
    resources = {k: dict(v) for k, v in resolved.resources.items()}
    two_pods = {"nodes": 2, "tasks_per_node": 1, "cpus": 1, "backend": "kubernetes"}
    resources["pretrain"] = {**resources.get("pretrain", {}), **two_pods}
    result = run_recipe(replace(resolved, resources=resources), options=RunOptions(backend="local"))
    assert result.state == "COMPLETED", result.error

    with LineageStore.open(load_settings()) as store:
        (run,) = store.list(PipelineRun, id=result.pipeline_run.id)
        finding = run.params["image_code_by_backend"]["kubernetes"]
        assert finding["verified"] is True, "the pods run the image's code, checked first"
        (pretrain,) = store.list(StageRun, pipeline_run_id=run.id, stage="pretrain")
        (attempt,) = store.list(Attempt, stage_run_id=pretrain.id)
        assert attempt.backend == "kubernetes" and attempt.state == "COMPLETED"
        assert attempt.resources is not None
        assert (attempt.resources["nodes"], attempt.resources["tasks_per_node"]) == (2, 1)
        assert pretrain.metrics["tasks"] == 2
    log = Path(attempt.log_path or "").read_text()
    assert "0: step 20/20 (100%)" in log, log[-2000:]  # rank 0's lines, labelled, from pod 0
    assert [line for line in log.splitlines() if line.startswith("1: ")] == [], "task 1 writes nothing of its own"
    out = Path(result.results["pretrain"].out_dir)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 10, "each step logged once"
    namespace, name = (attempt.job_id or "").split("/", 1)
    assert (namespace, name) not in k8s_cluster.services(), "the Job's Service went with it"
