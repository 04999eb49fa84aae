"""The replica pipeline flow on the ``tiny`` replica with the docker backend, through a real Prefect server.

Why a whole-pipeline run on Docker and not only the launcher suite: every stage job runs
in the job image with only the artifact root mounted, so what the pipeline hands a job
(the interpreter name, config and output paths, the working directory) must work inside
a container, and lineage must say which container and which image produced each output.
"""

from __future__ import annotations

import time

import pytest

from orchestrator.lineage import Attempt, LineageStore, PipelineRun, StageRun
from orchestrator.prefect_server import PrefectServer
from tests.services import docker_image, require_docker

pytestmark = [pytest.mark.prefect, pytest.mark.docker, pytest.mark.slow]

STAGES = ["data", "tokenize", "pretrain", "midtrain", "posttrain", "eval"]


def test_tiny_replica_flow_runs_every_stage_in_docker(
    prefect_server: PrefectServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = require_docker()
    image = docker_image("job")
    monkeypatch.setenv("OPENLAB_BACKENDS__DOCKER__IMAGE", image)
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.pipeline import replica_pipeline

    started = time.monotonic()
    state = replica_pipeline(recipe="marin-535b-a23b", replica="tiny", backend="docker", return_state=True)
    seconds = time.monotonic() - started
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["state"] == "COMPLETED"
    assert 0.0 <= summary["stages"]["eval"]["metrics"]["eval/moe/drop_fraction"] <= 1.0

    flow_run_id = state.state_details.flow_run_id
    image_id = client.images.get(image).id
    with LineageStore.open() as store:
        (run,) = store.list(PipelineRun, flow_run_id=str(flow_run_id))
        assert run.state == "COMPLETED" and run.backend == "docker"
        stages = {s.stage: s for s in store.list(StageRun, pipeline_run_id=run.id)}
        assert sorted(stages) == sorted(STAGES) and {s.state for s in stages.values()} == {"COMPLETED"}
        for name, srun in stages.items():
            (attempt,) = store.list(Attempt, stage_run_id=srun.id)
            assert attempt.state == "COMPLETED" and attempt.exit_code == 0, (name, attempt.reason)
            assert attempt.backend == "docker", name
            # the job id is the container's name; the container is removed once its log is kept
            assert attempt.job_id and attempt.job_id.startswith(f"openlab-openlab-{name}-"), (name, attempt.job_id)
            assert attempt.image_digest == image_id, (name, attempt.image_digest, image_id)
            assert attempt.command[0] == "python3", "the image's interpreter, not this machine's venv path"
            assert not client.containers.list(all=True, filters={"name": attempt.job_id})
            # what it used, measured in the container (the job image names its python)
            assert attempt.used and attempt.used["cpu_seconds"] > 0 and attempt.used["max_rss_bytes"] > 0, name

    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    cards = {a.key: str(a.data) for a in artifacts}
    assert {f"lineage-{s}" for s in STAGES} <= set(cards)
    assert stages["pretrain"].id in cards["lineage-pretrain"] and "docker" in cards["lineage-pretrain"]
    print(f"tiny replica on docker through Prefect: {seconds:.0f}s")
