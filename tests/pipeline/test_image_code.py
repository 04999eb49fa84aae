"""Where a job runs its image's code, the image must hold the run's tree, or the lineage would lie.

Against the real Docker engine and the job image `make test` builds with
infra/docker/build-job-image.sh (which labels it with the git ids of the code it copies in).
`mount_workdir = false` makes docker jobs run the image's code, as Kubernetes pods always do.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.lineage.models import PipelineRun, StageRun
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline import Pipeline, RunOptions, StageSpec, plan, run_pipeline
from orchestrator.provenance.git import path_hashes
from orchestrator.provenance.image import CODE_LABEL, ImageCodeMismatch, check_image_code, image_code
from orchestrator.settings import load_settings
from tests.pipeline.toy import git, make_repo, toy_configs, toy_pipeline
from tests.services import docker_image

pytestmark = [pytest.mark.docker]

REPO_ROOT = Path(__file__).resolve().parents[2]
CODE = ("flows", "orchestrator", "pyproject.toml", "workloads")

# A stage that reports which copy of `workloads` it imported: the image's or a mounted tree's.
WHICH = (
    "import json, pathlib, sys, workloads.moe; o = pathlib.Path(sys.argv[sys.argv.index('--out') + 1]); "
    "o.mkdir(parents=True, exist_ok=True); "
    "(o / 'metrics.json').write_text(json.dumps(dict(workloads_file=workloads.moe.__file__)))"
)


def _which_pipeline(repo: Path) -> Pipeline:
    stage = StageSpec(
        name="which",
        code_paths=("workloads",),
        command=("{python}", "-c", WHICH, "--config", "{config}", "--out", "{out}"),
    )
    return Pipeline(name="which", stages=(stage,), repo_root=repo)


def _image_only(image: str, **extra: object) -> RunOptions:
    overrides = {"image": image, "mount_workdir": False, **extra}
    return RunOptions(backend="docker", wait_poll=0.05, lease_ttl=10, launcher_overrides=overrides)


def test_the_job_image_is_labelled_with_the_tree_it_was_built_from() -> None:
    import docker

    job = docker_image("job")
    labels = docker.from_env().images.get(job).labels or {}
    declared = image_code(labels)
    assert declared is not None, f"{job} has no {CODE_LABEL} label: {labels}"
    assert sorted(declared) == list(CODE)
    tree = path_hashes(REPO_ROOT, list(CODE))
    assert declared == tree, (
        f"{job} was built from other code than this checkout: rebuild it (infra/docker/build-job-image.sh)"
    )


def test_a_stage_runs_the_image_code_once_the_image_is_checked(tmp_path: Path) -> None:
    job = docker_image("job")
    result = run_pipeline(_which_pipeline(REPO_ROOT), {"which": {}}, options=_image_only(job))
    assert result.ok, result.error
    with LineageStore.open(load_settings()) as store:
        [run] = store.list(PipelineRun, id=result.pipeline_run.id)
        finding = run.params["image_code"]
        assert finding["verified"] is True and finding["image"] == job
        assert finding["code"] == path_hashes(REPO_ROOT, list(CODE))
        [stage] = store.list(StageRun, pipeline_run_id=run.id)
        assert stage.state == "COMPLETED"
    metrics = result.results["which"].metrics
    # The installed copy ran, not the checkout: which is why the check above has to hold.
    assert "-packages/workloads/moe/" in metrics["workloads_file"], metrics  # site- or dist-packages
    assert not metrics["workloads_file"].startswith(str(REPO_ROOT))


def test_an_image_of_other_code_is_refused_before_anything_is_recorded(tmp_path: Path) -> None:
    job = docker_image("job")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True)
    for path in CODE:  # the checkout's tree as it is now (uncommitted edits too), then one edit
        target = clone / path
        if target.is_dir():
            shutil.rmtree(target)
            shutil.copytree(REPO_ROOT / path, target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(REPO_ROOT / path, target)
    assert path_hashes(clone, list(CODE)) == path_hashes(REPO_ROOT, list(CODE))
    (clone / "workloads" / "moe" / "util.py").write_text("# edited after the image was built\n", encoding="utf-8")

    with pytest.raises(ImageCodeMismatch) as refused:
        run_pipeline(_which_pipeline(clone), {"which": {}}, options=_image_only(job))
    message = str(refused.value)
    assert "\n" not in message
    assert f"docker: job image {job} was built from other code than this run's tree: workloads (image" in message
    assert "orchestrator" not in message.split("tree:")[1].split(";")[0]  # names only what differs
    assert "build-job-image.sh" in message and 'image_code_check = "warn"' in message
    with LineageStore.open(load_settings()) as store:
        assert store.list(PipelineRun) == []  # refused before the run was recorded

    # The dry run refuses alike, so `openlab explain` cannot promise a run that will not start.
    Path(os.environ["OPENLAB_CONFIG"]).write_text(f'[backends.docker]\nimage = "{job}"\nmount_workdir = false\n')
    with pytest.raises(ImageCodeMismatch, match="workloads"):
        plan(_which_pipeline(clone), {"which": {}}, settings=load_settings(), backend="docker")

    # Committing the edit changes nothing: the label records content, not a commit name.
    git(clone, "add", "-A")
    git(clone, "commit", "-q", "-m", "edit")
    with pytest.raises(ImageCodeMismatch):
        run_pipeline(_which_pipeline(clone), {"which": {}}, options=_image_only(job))


def test_an_unlabelled_image_is_refused_unless_the_check_is_relaxed(tmp_path: Path, caplog) -> None:
    base = docker_image("base")  # python only: built without the code label
    repo = make_repo(tmp_path)
    with pytest.raises(ImageCodeMismatch, match=f"job image {base} has no {CODE_LABEL} label"):
        run_pipeline(toy_pipeline(repo), toy_configs(), options=_image_only(base))

    # "warn" runs it and records why it could not be verified; the toy stages then fail, as they
    # must: their scripts are in the host repository, which the image does not hold.
    with caplog.at_level(logging.WARNING, logger="orchestrator.provenance.image"):
        result = run_pipeline(toy_pipeline(repo), toy_configs(), options=_image_only(base, image_code_check="warn"))
    assert any("image_code_check = warn" in r.getMessage() for r in caplog.records)
    assert not result.ok
    with LineageStore.open(load_settings()) as store:
        [run] = store.list(PipelineRun, id=result.pipeline_run.id)
        assert run.params["image_code"] == {"image": base, "verified": False, "reason": "no code label"}


def test_check_modes_and_unreadable_labels(tmp_path: Path) -> None:
    """No engine holds the image (a registry-only Kubernetes image): refused, unless relaxed."""
    repo = make_repo(tmp_path)
    with pytest.raises(ImageCodeMismatch, match="cannot read the labels of job image reg/x:1"):
        check_image_code("kubernetes", "reg/x:1", None, repo)
    assert check_image_code("kubernetes", "reg/x:1", None, repo, "off") == {
        "image": "reg/x:1",
        "verified": False,
        "reason": "check off",
    }
    assert check_image_code("kubernetes", "reg/x:1", None, repo, "warn")["reason"] == "labels unreadable"
    with pytest.raises(ConfigError, match=r"image_code_check = 'sometimes': use one of require, warn, off"):
        check_image_code("kubernetes", "reg/x:1", None, repo, "sometimes")
    tree = path_hashes(repo, ["stages", "README"])
    label = {CODE_LABEL: json.dumps(tree)}
    assert check_image_code("kubernetes", "reg/x:1", label, repo)["verified"] is True


def test_kubernetes_reads_the_label_through_the_local_engine() -> None:
    """Pods always run the image's code; the labels come from the local engine when it holds the image."""
    from orchestrator.launchers.kubernetes import KubernetesLauncher

    job = docker_image("job")
    k8s = KubernetesLauncher(config={"image": job})
    assert k8s.runs_image_code()
    assert image_code(k8s.image_labels()) == path_hashes(REPO_ROOT, list(CODE))
    assert KubernetesLauncher(config={"image": "registry.invalid/openlab/job:none"}).image_labels() is None


def test_a_run_outside_git_cannot_be_compared_and_says_so(tmp_path: Path) -> None:
    label = {CODE_LABEL: json.dumps({"workloads": "0" * 40})}
    refused = r"cannot compare job image x:1 with this run: .* not in a git working tree"
    with pytest.raises(ImageCodeMismatch, match=refused):
        check_image_code("kubernetes", "x:1", label, tmp_path)
    assert check_image_code("kubernetes", "x:1", label, tmp_path, "warn")["reason"] == "no git tree"
