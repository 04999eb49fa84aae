"""On a container backend a stage's environment is its image: rebuild the image, and the stage re-runs.

Against the real Docker engine, with the toy pipeline (tests/pipeline/toy.py) whose stage
scripts only need a Python: the job image and the base image both have one, and differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.lineage.models import Attempt, StageRun
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline import RunOptions, explain_recipe, plan, run_pipeline
from orchestrator.settings import load_settings
from tests.pipeline.toy import make_repo, toy_configs, toy_pipeline
from tests.services import docker_image, require_docker

pytestmark = [pytest.mark.docker]


def _run(repo: Path, image: str):
    options = RunOptions(backend="docker", wait_poll=0.05, lease_ttl=10, launcher_overrides={"image": image})
    result = run_pipeline(toy_pipeline(repo), toy_configs(), options=options)
    assert result.ok, result.error
    return result


def test_the_image_is_the_environment_of_a_docker_stage(tmp_path: Path) -> None:
    import docker

    require_docker()
    job, base = docker_image("job"), docker_image("base")
    engine = docker.from_env()
    digest = {
        name: (engine.images.get(name).attrs.get("RepoDigests") or [engine.images.get(name).id])[0]
        for name in (job, base)
    }
    assert digest[job] != digest[base]
    repo = make_repo(tmp_path)

    first = _run(repo, job)
    assert {r.state for r in first.results.values()} == {"COMPLETED"}
    with LineageStore.open(load_settings()) as store:
        for stage in store.list(StageRun, pipeline_run_id=first.pipeline_run.id):
            assert stage.identity_fields["environment"] == {"image": digest[job]}, stage.identity_fields
            [attempt] = store.list(Attempt, stage_run_id=stage.id)
            assert attempt.image == job  # the reference that ran, though the pipeline named none

    again = _run(repo, job)
    assert {r.state for r in again.results.values()} == {"REUSED"}

    # The dry run on the same backend computes the identities the run used: everything reusable.
    settings = load_settings()
    assert job == "openlab/job:latest"  # the launcher's default image, which plan() resolves
    plans = plan(toy_pipeline(repo), toy_configs(), settings=settings, backend="docker")
    assert [p.action for p in plans] == ["reuse", "reuse", "reuse"], [(p.stage, p.reason) for p in plans]

    rebuilt = _run(repo, base)
    assert {r.state for r in rebuilt.results.values()} == {"COMPLETED"}
    with LineageStore.open(settings) as store:
        gen = [s for s in store.list(StageRun, stage="gen") if s.state == "COMPLETED"]
        assert {s.identity_fields["environment"]["image"] for s in gen} == {digest[job], digest[base]}


def test_explain_plans_with_the_backends_environment() -> None:
    """`openlab explain --backend docker` must compute the identities `run --backend docker` will."""
    require_docker()
    plans = explain_recipe("marin-535b-a23b", "tiny", backend="docker")
    assert plans and plans[0].identity
    local = explain_recipe("marin-535b-a23b", "tiny", backend="local")
    assert plans[0].identity != local[0].identity  # data stage: the image's Python, not this one
