"""`openlab adopt`: a corpus built outside openlab becomes the data stage's output of a replica, the
next run reuses it and tokenizes it, and what openlab refuses is refused before anything is recorded.
Real workload stages, real SQLite, the command as a subprocess."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from orchestrator.lineage import Artifact, Attempt, DataSnapshot, LineageStore, PipelineRun, StageRun

TINY = ("marin-535b-a23b", "--replica", "tiny")


def _corpus_made_elsewhere(run_cli, tmp_path: Path) -> Path:
    """A corpus built by the data stage under another OPENLAB_HOME: a lab's existing data."""
    elsewhere = tmp_path / "elsewhere"
    made = run_cli("run", *TINY, "--until", "data", "--json", env={"OPENLAB_HOME": str(elsewhere)})
    assert made.returncode == 0, made.stderr[-2000:]
    (folder,) = [p for p in (elsewhere / "artifacts" / "data").iterdir() if p.is_dir()]
    corpus = tmp_path / "our-corpus"
    shutil.copytree(folder, corpus)
    return corpus


def test_an_adopted_corpus_is_reused_by_the_next_run(run_cli, openlab_home: Path, tmp_path: Path) -> None:
    corpus = _corpus_made_elsewhere(run_cli, tmp_path)
    refused = run_cli("adopt", *TINY, "--stage", "tokenize", str(corpus))
    assert refused.returncode == 2 and "stage data, which tokenize is built on, has no completed outputs" in (
        refused.stderr
    ), refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    with LineageStore.open() as store:
        assert store.list(PipelineRun) == [], "a refusal records nothing"

    adopted = run_cli("adopt", *TINY, "--stage", "data", str(corpus), "--json")
    assert adopted.returncode == 0, adopted.stderr[-2000:]
    said = json.loads(adopted.stdout)
    assert said["adopted_from"] == str(corpus.resolve()) and corpus.is_dir(), "copied, the source left alone"
    with LineageStore.open() as store:
        run = store.require(PipelineRun, said["pipeline_run_id"])
        assert (run.trigger, run.state, run.params["adopt"]["source"]) == ("adopt", "COMPLETED", str(corpus.resolve()))
        assert run.command == ["openlab", "adopt", *TINY, "--stage", "data", str(corpus), "--json"]
        stage = store.require(StageRun, said["stage_run_id"])
        assert stage.state == "COMPLETED" and stage.outputs["out"]["adopted_by"] == run.params["adopt"]["by"]
        art = store.require(Artifact, stage.outputs["out"]["artifact_id"])
        assert art.uri == said["path"] and Path(art.uri).is_dir()
        assert store.get(DataSnapshot, stage.outputs["out"]["snapshot_id"]) is not None, "a data stage's snapshot"
        from orchestrator.cards import stage_card

        assert f"- adopted from `{corpus.resolve()}` by {run.params['adopt']['by']}" in stage_card(store, stage.id)
        assert len(store.list(PipelineRun)) == 1

    again = run_cli("adopt", *TINY, "--stage", "data", str(corpus))
    assert again.returncode == 2 and "already has completed outputs" in again.stderr, again.stderr

    tokenized = run_cli("run", *TINY, "--until", "tokenize", "--json", env={"LOGNAME": "ada"})
    assert tokenized.returncode == 0, tokenized.stderr[-2000:]
    # who started it and what they typed, on the run, its card, its jobs and `lineage list --user`
    run_id = json.loads(tokenized.stdout)["pipeline_run_id"]
    with LineageStore.open() as store:
        run = store.require(PipelineRun, run_id)
        assert (run.user, run.trigger) == ("ada", "terminal")
        assert run.command == ["openlab", "run", *TINY, "--until", "tokenize", "--json"]
        from orchestrator.cards import pipeline_card

        card = pipeline_card(store, run_id)
        assert (
            "**Trigger:** terminal, by `ada`" in card
            and "**Command:** `` openlab run marin-535b-a23b --replica tiny" in card
        ), card
        (job,) = store.list(Attempt, stage_run_id=json.loads(tokenized.stdout)["stages"][1]["stage_run_id"])
        assert job.user == "ada", "the tokenize job was submitted by the same account"
    by_ada = json.loads(run_cli("lineage", "list", "-k", "pipeline_run", "--user", "ada", "--json").stdout)
    assert [r["id"] for r in by_ada] == [run_id], "the adoption ran as this process's own account, not ada"
    stages = {s["stage"]: s for s in json.loads(tokenized.stdout)["stages"]}
    assert stages["data"]["state"] == "REUSED" and stages["data"]["reused_from"] == said["stage_run_id"]
    assert stages["tokenize"]["state"] == "COMPLETED", stages["tokenize"]
    verified = run_cli("lineage", "verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr

    # adopted with a value set over the recipe: the command it names to reuse it sets it too (without,
    # the run asked for another identity, and ran the stage it was told would be reused)
    sets = ("--set", "data.max_bytes_per_domain=150000")
    with_set = run_cli("adopt", *TINY, "--stage", "data", str(corpus), *sets, "--backend", "local", "--json")
    assert with_set.returncode == 0, with_set.stderr[-2000:]
    named = json.loads(with_set.stdout)["next"]
    assert named == f"openlab run {' '.join(TINY)} --backend local --set data.max_bytes_per_domain=150000", named
    planned = json.loads(run_cli("explain", *shlex.split(named)[2:], "--until", "data", "--json").stdout)
    assert planned["stages"][0]["action"] == "reuse", planned


def test_a_failed_recording_puts_a_moved_folder_back(
    run_cli, openlab_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--move renames the user's folder into openlab's outputs; if recording it then fails, the folder
    goes back where it was and no stage run claims anything (the adoption's pipeline run says FAILED)."""
    from orchestrator.pipeline import adopt as adopt_module
    from orchestrator.pipeline.execute import RunOptions, finish_pipeline, start_recipe
    from orchestrator.pipeline.outputs import output_dir
    from orchestrator.recipes import resolve

    corpus = _corpus_made_elsewhere(run_cli, tmp_path)
    files = sorted(p.relative_to(corpus) for p in corpus.rglob("*"))
    ctx = start_recipe(resolve("marin-535b-a23b", "tiny").until("data"), options=RunOptions(trigger="adopt"))

    def fail(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("the database went away")

    with monkeypatch.context() as patched, pytest.raises(RuntimeError, match="database went away"):
        patched.setattr(adopt_module, "_record", fail)
        adopt_module.adopt_stage(ctx, "data", corpus, move=True)
    finish_pipeline(ctx, "FAILED", "test")
    assert sorted(p.relative_to(corpus) for p in corpus.rglob("*")) == files, "the user's folder is back, whole"
    digest = adopt_module.stage_identity(ctx, ctx.pipeline.stage("data"), {}).digest
    out = output_dir(ctx.settings, "data", digest)
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*")), "nothing left in openlab's outputs"
    assert ctx.store.list(StageRun, pipeline_run_id=ctx.id) == []

    moved = run_cli("adopt", *TINY, "--stage", "data", str(corpus), "--move", "--json")
    assert moved.returncode == 0, moved.stderr[-2000:]
    assert not corpus.exists() and Path(json.loads(moved.stdout)["path"]).is_dir()
