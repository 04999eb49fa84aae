"""`openlab rerun PRUN`: a recorded run asked again, as it was asked, recorded as its retry."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.lineage import LineageStore, PipelineRun, Relation, StageRun
from orchestrator.pipeline.rerun import rerun_of


def test_a_failed_run_is_run_again_as_it_was_asked_once_the_cause_is_fixed(run_cli, openlab_home: Path) -> None:
    """The local backend's python was wrong: the run failed at its first stage. With the setting fixed,
    `rerun` runs the same recipe, replica, --set value and --until, on the same backend, as the failed
    run's retry (the failure stays on record), and says what changed since it."""
    config = openlab_home / "openlab.toml"
    config.write_text('[backends.local]\npython = "/nonexistent/python3"\n')
    failed = run_cli("run", "marin-535b-a23b", "-r", "tiny", "--until", "tokenize", "--set", "tokenizer.vocab_size=300")
    assert failed.returncode == 1 and "cannot run '/nonexistent/python3'" in failed.stderr, failed.stderr
    with LineageStore.open() as store:
        [first] = store.list(PipelineRun)
    assert first.state == "FAILED"

    config.write_text("")  # the fix
    planned = run_cli("rerun", first.id, "--dry-run", "--json")
    assert planned.returncode == 0, planned.stderr
    assert [(p["stage"], p["action"]) for p in json.loads(planned.stdout)["stages"]] == [
        ("data", "run"),
        ("tokenize", "run"),
    ]
    with LineageStore.open() as store:
        assert len(store.list(PipelineRun)) == 1  # the dry run started and recorded nothing
    again = run_cli("rerun", first.id[:12])
    assert again.returncode == 0, again.stderr
    assert again.stderr.startswith(
        f"rerun of {first.id} (FAILED): marin-535b-a23b -r tiny --until tokenize --set tokenizer.vocab_size=300"
        " on local"
    ), again.stderr
    assert "what changed since the run it reruns" in again.stdout and first.id in again.stdout, again.stdout
    with LineageStore.open() as store:
        retry = next(r for r in store.list(PipelineRun) if r.id != first.id)
        assert store.require(PipelineRun, first.id).state == "FAILED"  # the record of the failure is kept
        assert retry.state == "COMPLETED" and retry.backend == "local" and retry.replica == "tiny"
        assert retry.params["retry_of"] == first.id
        assert retry.params["recipe"]["run_set"] == {"tokenizer.vocab_size": 300}
        assert [s.stage for s in store.list(StageRun, pipeline_run_id=retry.id)] == ["data", "tokenize"]
        [link] = store.list(Relation, subject_id=retry.id, role="retry-of")
        assert link.object_id == first.id and link.relation == "wasInformedBy"
    assert retry.command is not None and retry.command[1:3] == ["rerun", first.id[:12]]
    listed = run_cli("lineage", "list", "-k", "pipeline_run", env={"COLUMNS": "250"}).stdout
    assert f"retry of {first.id}" in " ".join(listed.split()), listed  # the recovery says what it recovers

    for ref, want in (
        ("prun_nosuch", "error: no lineage record with id 'prun_nosuch'"),
        (link.id, f"error: {link.id} is a relation, not a pipeline run: rerun takes runs (prun_…)"),
    ):
        bad = run_cli("rerun", ref)
        assert bad.returncode == 2 and bad.stderr.startswith(want) and len(bad.stderr.splitlines()) == 1, bad.stderr


def _recorded(store: LineageStore, **params: object) -> PipelineRun:
    with store.transaction() as tx:
        return tx.add(PipelineRun(recipe="marin-535b-a23b", replica="tiny", backend="slurm", params=params))


def test_what_a_run_asked_is_read_back_from_its_record(openlab_home: Path) -> None:
    """Its stages give its --until (none when it ran the replica whole), its sweep and issue are kept,
    its force is not; a run that records no recipe, or stopped at a stage the replica no longer has,
    is refused in one line."""
    asked = {"recipe": "marin-535b-a23b", "replica": "tiny", "run_set": {"seed": 4}}
    sweep = {"id": "swp_0123456789abcdef0123", "run": 2, "of": 3}
    with LineageStore.open() as store:
        cut = _recorded(
            store, recipe={**asked, "stages": ["data", "tokenize"]}, sweep=sweep, issue="lab/exp#7", force=True
        )
        again = rerun_of(store, cut.id)
        assert (again.until, again.backend, again.issue, again.params) == (
            "tokenize",
            "slurm",
            "lab/exp#7",
            {"sweep": sweep},
        )
        assert again.recipe.stages == ("data", "tokenize") and again.recipe.run_set == {"seed": 4}
        whole = rerun_of(store, _recorded(store, recipe=asked).id)
        assert whole.until is None and whole.params == {} and whole.issue is None and whole.git_ref is None
        assert rerun_of(store, _recorded(store, recipe=asked, git_ref="v1.2").id).git_ref == "v1.2"  # said, not run
        assert rerun_of(store, _recorded(store, recipe=asked, git_ref="HEAD").id).git_ref is None
        assert not again.issue_required  # the first run did not require its link
        for flag in ({"issue_required": True}, {"require_issue": True}):  # as a terminal / the UI records it
            assert rerun_of(store, _recorded(store, recipe=asked, issue="lab/exp#7", **flag).id).issue_required
        assert whole.recipe.stages == ("data", "tokenize", "pretrain", "midtrain", "posttrain", "eval")
        for params, message in (
            ({}, "records no recipe (a pipeline started from code)"),
            ({"recipe": {**asked, "stages": ["data", "distill"]}}, "stopped after distill, which is no longer a stage"),
            ({"recipe": {**asked, "run_set": {"pretrain.lrr": 1}}}, "--set pretrain.lrr: no such recipe field"),
        ):
            with pytest.raises(ConfigError, match=re.escape(message)):
                rerun_of(store, _recorded(store, **params).id)
