"""What an auditor reads from lineage: `verify`, `diff`, `show`, `compare` and the exports say what
happened, not less (an output deleted by hand, a failed stage, where a reused stage's outputs came
from, where a dirty tree's changes are) and never a secret a job was typed with.

Records are built directly in a store, as a pipeline would have recorded them; no pipeline runs.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import ConfigError
from orchestrator.lineage import (
    Artifact,
    Attempt,
    Commit,
    DataSnapshot,
    LineageStore,
    PipelineRun,
    StageRun,
    open_store,
    utcnow,
)
from orchestrator.settings import load_settings

T0 = utcnow() - dt.timedelta(days=1)


def _at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


# -- verify: an output folder deleted by hand -------------------------------------------------


def test_verify_names_an_output_deleted_by_hand_and_notes_one_on_another_machine(
    run_cli, openlab_home: Path, tmp_path: Path
) -> None:
    """`mv artifacts/pretrain/<identity> /tmp/x` passed `lineage verify` as "data present": a removal
    openlab made is recorded (gc, a forced re-run), so a folder gone without one is a problem. An
    output whose artifact root is not on this machine (another machine's storage) is not checked,
    and the line that says lineage verified must not claim it was."""
    from orchestrator.snapshots import content_hash

    out = load_settings().artifacts_dir / "pretrain" / "0123456789abcdef"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.pt").write_bytes(b"weights")
    elsewhere = tmp_path / "cluster" / "artifacts" / "tokenize" / "fedcba9876543210"  # that root is not here
    with open_store() as store, store.transaction() as tx:
        stage = tx.add(StageRun(stage="pretrain", identity="i-pre", state="COMPLETED"))
        hashed = content_hash(out)
        made = tx.add(Artifact(name="pretrain/out", artifact_type="folder", uri=str(out), content_hash=hashed))
        tx.relate("wasGeneratedBy", made, stage)
        away = tx.add(Artifact(name="tokenize/out", artifact_type="folder", uri=str(elsewhere), content_hash="d" * 64))
        # a snapshot taken on the cluster's storage, audited from here: not mounted, not checked
        corpus = tmp_path / "lustre" / "corpus" / "v3"
        manifest = tmp_path / "lustre-home" / "m.json"  # and its manifest in that machine's openlab home
        on_lustre = tx.add(DataSnapshot(id="f" * 64, path=str(corpus), files=3, bytes=30, manifest_path=str(manifest)))
        # one whose manifest is here, but whose data was on scratch storage this machine has not mounted
        scratch = tmp_path / "scratch" / "corpus"
        kept = load_settings().snapshots_dir / f"{'e' * 64}.json"
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps({"id": "e" * 64, "path": str(scratch), "entries": []}))
        on_scratch = tx.add(DataSnapshot(id="e" * 64, path=str(scratch), files=1, bytes=1, manifest_path=str(kept)))
        gone_by_gc = tx.add(
            Artifact(
                name="pretrain/out",
                artifact_type="folder",
                uri=str(out.parent / "aaaaaaaaaaaaaaaa"),
                content_hash="e" * 64,
                removed_at=utcnow(),
                removed_reason="openlab gc by ada@vm",
            )
        )
    assert gone_by_gc.removed_at is not None

    shutil.move(out, tmp_path / "x")  # deleted by hand: no record says so
    broken = run_cli("lineage", "verify", "--json")
    assert broken.returncode == 1, broken.stdout + broken.stderr
    report = json.loads(broken.stdout)
    assert [p["record"] for p in report["problems"]] == [f"artifact:{made.id}"], report
    message = report["problems"][0]["message"]
    assert f"stage pretrain, stage run {stage.id}" in message and f"output folder {out} is missing" in message
    assert "`openlab gc` records each removal" in message and "deleted by hand" in message, message
    said = run_cli("lineage", "verify")
    assert said.returncode == 1 and f"artifact:{made.id}: pretrain/out (stage pretrain" in said.stdout, said.stdout

    shutil.move(tmp_path / "x", out)  # put back: what is on this machine verifies; what is not, is noted
    ok = run_cli("lineage", "verify", "--json")
    assert ok.returncode == 0, ok.stdout
    report = json.loads(ok.stdout)
    assert report["ok"] is True and report["problems"] == []
    assert report["notes"] == [
        f"1 snapshot not on this machine, not checked (their folder {tmp_path / 'lustre-home'} is not here): "
        f"{on_lustre.id}",
        f"1 snapshot not on this machine, not checked (their folder {tmp_path / 'scratch'} is not here): "
        f"{on_scratch.id}",
        f"1 artifact not on this machine, not checked (their artifact root {elsewhere.parent.parent} "
        f"is not here): {away.id}",
    ], report["notes"]
    text = run_cli("lineage", "verify", env={"COLUMNS": "300"})
    assert text.returncode == 0 and "note: 1 artifact not on this machine, not checked" in text.stdout
    assert "data present," not in text.stdout, "the unchecked artifact must not read as checked"
    assert "lineage verified: event chain intact, records match their log, commits present, data present where" in (
        text.stdout
    ), text.stdout

    # this openlab's own artifact root gone whole (`rm -rf $OPENLAB_HOME/artifacts`), beside its own SQLite
    # file: every output in it deleted, not "another machine's storage" (it was a note, and exit 0)
    root = load_settings().artifacts_dir
    shutil.move(root, tmp_path / "all-outputs")
    gone = run_cli("lineage", "verify", "--json")
    assert gone.returncode == 1, gone.stdout
    (problem,) = json.loads(gone.stdout)["problems"]
    assert problem["record"] == f"artifact:{made.id}" and f"output folder {out} is missing" in problem["message"]


def test_a_commit_whose_repository_is_not_here_is_noted_not_called_present(run_cli, tmp_path: Path) -> None:
    """Recorded from a clone since moved (or on another machine), a commit could not be looked up, and
    the line said "commits present" of it all the same."""
    from orchestrator.lineage import Commit

    moved = tmp_path / "clone-since-moved"
    with open_store() as store, store.transaction() as tx:
        commit = tx.add(Commit(id="c" * 40, sha="c" * 40, repo_path=str(moved)))
    report = json.loads(run_cli("lineage", "verify", "--json").stdout)
    assert report["ok"] is True and report["notes"] == [
        f"1 commit not on this machine, not checked (their repository {moved} is not here): {commit.id}"
    ]
    text = run_cli("lineage", "verify", env={"COLUMNS": "300"})
    assert text.returncode == 0, text.stdout
    assert "commits present where their repository is on this machine, data present" in text.stdout, text.stdout


def test_verify_on_both_databases_skips_removed_outputs_and_names_missing_ones(store: LineageStore) -> None:
    from orchestrator.lineage.verify import verify

    settings = load_settings()
    root = settings.artifacts_dir
    root.mkdir(parents=True)
    with store.transaction() as tx:
        tx.add(Artifact(name="eval/out", artifact_type="folder", uri=str(root / "eval" / "x"), content_hash="c" * 64))
        tx.add(
            Artifact(
                name="eval/out",
                artifact_type="folder",
                uri=str(root / "eval" / "y"),
                content_hash="c" * 64,
                removed_at=utcnow(),
                removed_reason="replaced by a forced re-run",
            )
        )
    notes: list[str] = []
    problems = verify(store, settings, notes=notes)
    assert len(problems) == 1 and "eval/out (stage eval): output folder" in problems[0].message, problems
    assert notes == []


# -- job commands: secrets typed as NAME=value or an option ------------------------------------


def test_a_jobs_recorded_command_masks_secret_options_and_name_value_pairs(run_cli, openlab_home: Path) -> None:
    """`job run -- env DB_PASSWORD=x ...` recorded x in the attempt's command (and so in every
    export); the rule that masks a run's typed command now masks a job's."""
    typed = ["env", "DB_PASSWORD=literalpw98765", "sh", "-c", "echo ok", "sh", "--db-password", "pw2secret99"]
    done = run_cli("job", "run", "-b", "local", "--", *typed)
    assert done.returncode == 0, done.stderr
    assert "ok" in done.stdout  # the job itself ran with the real values
    with open_store() as store:
        (attempt,) = store.list(Attempt)
        assert attempt.command == ["env", "DB_PASSWORD=***", "sh", "-c", "echo ok", "sh", "--db-password", "***"]
        events = json.dumps([e.payload for e in store.events()])
    exported = run_cli("lineage", "export", "-f", "prov").stdout
    for text in (events, exported, (openlab_home / "lineage.db").read_bytes().decode("latin-1")):
        assert "literalpw98765" not in text and "pw2secret99" not in text


def test_one_rule_masks_a_typed_run_and_a_jobs_command() -> None:
    from orchestrator.provenance import invocation
    from orchestrator.secrets import redact_argv

    assert invocation.redact_argv is redact_argv
    assert redact_argv(["train.py", "--api-key", "k1234567", "key_dim=64"], ["zzz-job-own-secret"]) == [
        "train.py",
        "--api-key",
        "***",
        "key_dim=64",  # a shape, not a secret
    ]
    assert redact_argv(["--note", "uses zzz-job-own-secret"], ["zzz-job-own-secret"]) == ["--note", "uses ***"]


# -- diff against a failed run ---------------------------------------------------------------


def _failed_pair(store: LineageStore) -> dict[str, Any]:
    """A completed run and one whose pretrain failed (lr negative); data reused by the second."""
    with store.transaction() as tx:
        a = tx.add(PipelineRun(recipe="r", replica="tiny", backend="local", state="COMPLETED", started_at=_at(0)))
        b = tx.add(
            PipelineRun(
                recipe="r",
                replica="tiny",
                backend="local",
                state="FAILED",
                started_at=_at(60),
                params={"recipe": {"run_set": {"pretrain.lr": -1}}},
            )
        )
        data_a = tx.add(
            StageRun(pipeline_run_id=a.id, stage="data", identity="d", state="COMPLETED", started_at=_at(1))
        )
        tx.add(
            StageRun(
                pipeline_run_id=b.id,
                stage="data",
                identity="d",
                state="REUSED",
                reused_from=data_a.id,
                started_at=_at(61),
            )
        )
        tx.add(
            StageRun(
                pipeline_run_id=a.id,
                stage="pretrain",
                identity="p1",
                identity_fields={"config": {"lr": 0.01}},
                state="COMPLETED",
                metrics={"eval": {"code": {"loss": 5.27558}}, "steps": 10},
                started_at=_at(2),
            )
        )
        pre_b = tx.add(
            StageRun(
                pipeline_run_id=b.id,
                stage="pretrain",
                identity="p2",
                identity_fields={"config": {"lr": -1}},
                state="FAILED",
                metrics={"steps": 3},
                started_at=_at(62),
            )
        )
        tx.add(
            Attempt(
                stage_run_id=pre_b.id,
                backend="local",
                job_id="1",
                state="FAILED",
                reason="exit code 1: ValueError: lr must be positive",
            )
        )
    return {"a": a.id, "b": b.id}


def test_diff_says_a_stage_failed_and_a_metric_it_never_reported_is_missing_not_moved(
    run_cli, openlab_home: Path
) -> None:
    with open_store() as store:
        ids = _failed_pair(store)
    a, b = ids["a"], ids["b"]
    out = run_cli("lineage", "diff", a, b, "-m", "eval/code/loss", "-m", "steps", env={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "pretrain: 1 field(s) differ" in text, text
    assert "  state: COMPLETED -> FAILED\n" in text, text
    assert f"    FAILED in {b}: exit code 1: ValueError: lr must be positive\n" in text, text
    assert "  metrics: 1 of 2 moved, 1 missing\n" in text, text
    assert f"eval/code/loss  5.27558 -> -  missing in {b} (pretrain FAILED)" in text, text
    assert "steps           10 -> 3  (-7, -70.00%)" in text, text
    assert "data: identical" in text  # a reuse is a completion: nothing to say of its state
    doc = json.loads(run_cli("lineage", "diff", a, b, "-m", "eval/code/loss", "--json").stdout)
    assert doc["states"] == {
        "pretrain": {"old": "COMPLETED", "new": "FAILED", "new_reason": "exit code 1: ValueError: lr must be positive"}
    }
    (missing,) = doc["metrics"]["pretrain"]
    assert missing["missing_in"] == b and missing["why"] == "pretrain FAILED" and missing["new"] is None


def test_diff_of_the_same_inputs_that_ended_differently_is_not_identical(store: LineageStore) -> None:
    from orchestrator.lineage.diff import diff_records

    with store.transaction() as tx:
        ok = tx.add(StageRun(stage="eval", identity="e", state="COMPLETED", metrics={"loss": 2.0}))
        bad = tx.add(StageRun(stage="eval", identity="e", state="CANCELLED", error="cancelled by ada"))
    (section,) = diff_records(store, ok, bad, ["*"])
    assert section.fields == [] and section.states == {
        "old": "COMPLETED",
        "new": "CANCELLED",
        "new_reason": "cancelled by ada",
    }
    assert section.moved == [] and [(c.metric, c.missing_in, c.why) for c in section.missing] == [
        ("loss", bad.id, "eval CANCELLED")
    ]


# -- exports: a reuse, a retry, a dirty tree ---------------------------------------------------


def _reused_history(store: LineageStore, tmp_path: Path) -> dict[str, Any]:
    """Run 1 made data (a snapshot and a folder), tokenize and pretrain; run 2 reused data and
    tokenize and trained again on run 1's tokens; run 3 is a retry of run 2."""
    art = tmp_path / "artifacts"
    with store.transaction() as tx:
        commit = tx.add(Commit(id="a" * 40 + "+" + "b" * 16, sha="a" * 40, dirty=True, patch_hash="b" * 64))
        first = tx.add(PipelineRun(recipe="toy", replica="tiny", state="COMPLETED", started_at=_at(0)))
        second = tx.add(PipelineRun(recipe="toy", replica="tiny", state="COMPLETED", started_at=_at(60)))
        retry = tx.add(PipelineRun(recipe="toy", replica="tiny", state="COMPLETED", started_at=_at(120)))
        for run in (first, second, retry):
            tx.relate("wasAssociatedWith", run, commit, role="code")
        tx.relate("wasInformedBy", retry, second, role="retry-of")

        def stage(run: PipelineRun, name: str, minute: float, **kw: Any) -> StageRun:
            return tx.add(StageRun(pipeline_run_id=run.id, stage=name, identity=name, started_at=_at(minute), **kw))

        def output(name: str, folder: str) -> Artifact:
            return tx.add(Artifact(name=f"{name}/out", artifact_type="folder", uri=str(art / name / folder),
                                   content_hash=folder * 4))  # fmt: skip

        data = stage(first, "data", 1, state="COMPLETED")
        data_out = output("data", "d" * 16)  # a data stage's folder is also a snapshot: one hash, one path
        snap = tx.add(DataSnapshot(id=data_out.content_hash, path=data_out.uri, files=2, bytes=9,
                                   manifest_path="/m.json"))  # fmt: skip
        tx.relate("wasGeneratedBy", data_out, data)
        tx.relate("wasGeneratedBy", snap, data)
        tok = stage(first, "tokenize", 2, state="COMPLETED")
        tx.relate("used", tok, data_out, role="data")
        tx.relate("used", tok, snap, role="data")
        tokens = output("tokenize", "e" * 16)
        tx.relate("wasGeneratedBy", tokens, tok)
        pre1 = stage(first, "pretrain", 3, state="COMPLETED")
        tx.relate("used", pre1, tokens, role="tokens")
        tx.relate("wasGeneratedBy", output("pretrain", "1" * 16), pre1)

        data2 = stage(second, "data", 61, state="REUSED", reused_from=data.id)
        tx.relate("wasInformedBy", data2, data, role="reused")
        tok2 = stage(second, "tokenize", 62, state="REUSED", reused_from=tok.id)
        tx.relate("wasInformedBy", tok2, tok, role="reused")
        pre2 = stage(second, "pretrain", 63, state="COMPLETED")
        tx.relate("used", pre2, tokens, role="tokens")
        tx.relate("wasGeneratedBy", output("pretrain", "2" * 16), pre2)
    return {k: v for k, v in locals().items() if hasattr(v, "kind") and hasattr(v, "id")}


def test_ro_crate_says_where_a_reused_stages_outputs_came_from(run_cli, openlab_home: Path, tmp_path: Path) -> None:
    """A reused stage's CreateAction had no object and no result, so the crate never said where
    pretrain's tokens came from, and the data snapshot was not in it; its name said "reused" twice."""
    import warnings

    from rocrate.rocrate import ROCrate

    with open_store() as store:
        h = _reused_history(store, tmp_path)
    crate_dir = tmp_path / "crate"
    done = run_cli("lineage", "export", h["second"].id, "-f", "ro-crate", "-o", str(crate_dir))
    assert done.returncode == 0, done.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        crate = ROCrate(crate_dir)
    actions = {a.id: a for a in crate.get_by_type("CreateAction")}
    data, tok, pre = (actions[f"#{h[k].id}"] for k in ("data2", "tok2", "pre2"))
    assert (data["name"], tok["name"], pre["name"]) == ("data (reused)", "tokenize (reused)", "pretrain (completed)")

    def files(entities: Any) -> list[Any]:  # the data entities, not the settings and results beside them
        return [
            e
            for e in (entities if isinstance(entities, list) else [entities] if entities else [])
            if e.type != "PropertyValue"
        ]

    def ids(entities: Any) -> set[str]:
        return {e["identifier"] for e in files(entities)}

    # the outputs the reuse took, as the earlier run's data stage made them: the folder, its snapshot
    snapshot = next(e for e in crate.get_by_type("Dataset") if e.get("identifier") == h["snap"].id)
    assert "data snapshot of 2 files" in snapshot["description"]
    assert ids(data.get("result")) == {h["snap"].id}
    assert ids(tok.get("object")) == {h["snap"].id}
    assert ids(tok.get("result")) == {h["tokens"].content_hash}
    assert [e.type for e in files(tok["result"])] == ["Dataset"], "an output folder is a Dataset, not a File"
    assert ids(pre["object"]) <= ids(tok["result"]), "pretrain's input is what the reused tokenize has"
    assert f"reuses the outputs of stage run {h['tok'].id} of run {h['first'].id}" in tok["description"]
    run = actions[f"#{h['second'].id}"]
    assert h["tokens"].content_hash not in ids(run["object"]), "made by a stage of the run (a reused one)"


def test_prov_keeps_the_role_that_tells_a_reuse_from_a_retry(openlab_home: Path, tmp_path: Path) -> None:
    """wasInformedBy dropped its role, so a reuse and a retry read the same in PROV; the role is an
    openlab attribute (PROV allows prov:role on communication nowhere), and the `prov` library reads
    the document back. A reused stage's source's inputs and outputs are exported with it."""
    from prov.model import ProvCommunication, ProvDocument, ProvGeneration

    from orchestrator.lineage.export import export

    with open_store() as store:
        h = _reused_history(store, tmp_path)
        text = export(store, "prov", [h["second"].id, h["retry"].id])
    doc = ProvDocument.deserialize(content=text, format="json")
    roles = {
        (str(c.formal_attributes[0][1]), str(c.formal_attributes[1][1])): {
            str(v) for v in c.get_attribute("openlab:role")
        }
        for c in doc.get_records(ProvCommunication)
    }
    assert roles[(f"openlab:{h['tok2'].id}", f"openlab:{h['tok'].id}")] == {"reused"}
    assert roles[(f"openlab:{h['retry'].id}", f"openlab:{h['second'].id}")] == {"retry-of"}
    generated = {
        (str(g.formal_attributes[0][1]), str(g.formal_attributes[1][1])) for g in doc.get_records(ProvGeneration)
    }
    assert (f"openlab:{h['tokens'].id}", f"openlab:{h['tok'].id}") in generated, "where the reused tokens came from"
    again = ProvDocument.deserialize(content=doc.serialize(format="json"), format="json")
    assert again == doc


def test_show_and_the_exports_say_where_a_dirty_trees_changes_are(run_cli, openlab_home: Path, tmp_path: Path) -> None:
    """`lineage show 'commit:<sha>+<patch>'` showed only the patch's hash; the patch is a file in the
    blob store, which `show` names (and how to apply it), as do the exports."""
    from orchestrator.lineage.export import export

    with open_store() as store:
        h = _reused_history(store, tmp_path)
    commit = h["commit"]
    blob = load_settings().blobs_dir / commit.patch_hash
    missing = run_cli("lineage", "show", f"commit:{commit.id}", env={"COLUMNS": "300"})
    assert missing.returncode == 0, missing.stderr
    assert f"patch           {blob}  (missing from this openlab home" in missing.stdout, missing.stdout
    blob.parent.mkdir(parents=True)
    blob.write_text("diff --git a/train.py b/train.py\n")
    shown = run_cli("lineage", "show", f"commit:{commit.id}", env={"COLUMNS": "300"})
    assert f"patch           {blob}  (`git apply --binary {blob}` on {commit.sha} rebuilds the tree)" in shown.stdout
    doc = json.loads(run_cli("lineage", "show", commit.id, "--json").stdout)
    assert doc["patch"] == {"path": str(blob), "present": True, "apply": f"git apply --binary {blob}"}
    assert doc["record"]["patch_hash"] == commit.patch_hash

    with open_store() as store:
        prov = json.loads(export(store, "prov", [h["first"].id]))
    assert prov["entity"][f"openlab:{commit.id}"]["openlab:patch_location"] == blob.resolve().as_uri()
    crate_dir = tmp_path / "crate"
    assert run_cli("lineage", "export", h["first"].id, "-f", "ro-crate", "-o", str(crate_dir)).returncode == 0
    graph = {e["@id"]: e for e in json.loads((crate_dir / "ro-crate-metadata.json").read_text())["@graph"]}
    patch = graph[blob.resolve().as_uri()]
    assert patch["@type"] == "File" and patch["identifier"] == commit.patch_hash
    assert graph[f"#commit-{commit.id}"]["hasPart"] == [{"@id": blob.resolve().as_uri()}]


# -- compare --sort: how many columns a name matches -----------------------------------------


def test_sort_by_a_metric_three_stages_report_says_three(store: LineageStore) -> None:
    from orchestrator.lineage.compare import compare_runs

    with store.transaction() as tx:
        runs = [tx.add(PipelineRun(recipe="r", replica="tiny", started_at=_at(i))) for i in range(2)]
        for i, run in enumerate(runs):
            for j, name in enumerate(("pretrain", "midtrain", "eval")):
                tx.add(
                    StageRun(
                        pipeline_run_id=run.id,
                        stage=name,
                        identity=f"{name}{i}",
                        metrics={"eval/code/loss": 5.0 - j - i},
                        started_at=_at(i * 10 + j),
                    )
                )
    comparison = compare_runs(store, runs, ["*"])
    with pytest.raises(ConfigError) as raised:
        comparison.sorted_by("eval/code/loss")
    assert str(raised.value) == (
        "--sort 'eval/code/loss': names three columns (pretrain:eval/code/loss, midtrain:eval/code/loss, "
        "eval:eval/code/loss); give STAGE:METRIC"
    )
    assert [r.run.id for r in comparison.sorted_by("eval:eval/code/loss").rows] == [runs[1].id, runs[0].id]


def test_a_host_refusal_lists_at_most_twenty_of_a_clusters_hosts(store: LineageStore) -> None:
    from orchestrator.lineage.listing import RecordFilter, list_records

    with store.transaction() as tx:
        tx.add(Attempt(backend="slurm", job_id="1", host="n[001-050]"))
    with pytest.raises(ConfigError) as raised:
        list_records(store, ["attempt"], RecordFilter(host="n0017"))
    said = str(raised.value)
    assert said.startswith("--host 'n0017': no job in lineage ran on such a host; did you mean 'n017'? "), said
    assert "hosts jobs ran on (50): n001, n002," in said and said.endswith("n020, …") and "n021" not in said


def test_the_head_anchor_verify_prints_catches_the_latest_run_deleted_with_all_after_it(
    run_cli, openlab_home: Path
) -> None:
    """A failed run deleted from the database with every event from its first on verifies as intact: the
    chain cannot show its own end cut off, and `verify` gave no anchor of the log as it stood to publish.
    It now prints the head ``SEQ:HASH`` (and ``--json`` has it), and the run's card its end anchor."""
    import sqlite3

    from orchestrator.cards import collect_pipeline, render_pipeline
    from orchestrator.lineage.models import RECORD_TYPES

    with open_store() as store:
        with store.transaction() as tx:
            tx.add(PipelineRun(name="good", recipe="r", replica="tiny", state="COMPLETED", ended_at=utcnow()))
        with store.transaction() as tx:
            failed = tx.add(PipelineRun(name="bad", recipe="r", replica="tiny", state="RUNNING"))
        with store.transaction() as tx:
            tx.update(failed, state="FAILED", error="pretrain: exit 3", ended_at=utcnow())
        card = render_pipeline(collect_pipeline(store, failed.id))
    shown = run_cli("lineage", "verify")
    assert shown.returncode == 0, shown.stderr
    head = json.loads(run_cli("lineage", "verify", "--json").stdout)["head"]
    assert f"head {head}: publish it" in shown.stdout, shown.stdout
    assert f"**End anchor:** `{head}`, the event that recorded how it ended (FAILED)." in card, card

    # the failed run removed, events and row, as someone with write access to the file would
    db = sqlite3.connect(openlab_home / "lineage.db")
    first = db.execute("select min(seq) from event where record_id = ?", (failed.id,)).fetchone()[0]
    db.execute("delete from event where seq >= ?", (first,))
    db.execute(f"delete from {RECORD_TYPES['pipeline_run'].__tablename__} where id = ?", (failed.id,))
    db.commit()
    db.close()
    assert run_cli("lineage", "verify").returncode == 0  # the chain alone: intact, what is left of it
    caught = run_cli("lineage", "verify", "--anchor", head)
    assert caught.returncode == 1 and f"no event #{head.split(':')[0]}" in caught.stdout, caught.stdout


def test_verify_names_the_file_of_an_output_whose_content_changed(run_cli, openlab_home: Path) -> None:
    """One byte of a checkpoint flipped, size and mtime kept: verify caught it, but named only the output
    folder and two hashes; the manifest recorded with the output says which file."""
    import os

    from orchestrator.pipeline.outputs import hash_output

    settings = load_settings()
    out = settings.artifacts_dir / "pretrain" / "0123456789abcdef"
    (out / "checkpoint").mkdir(parents=True)
    state = out / "checkpoint" / "state.pt"
    state.write_bytes(b"weights-0")
    (out / "metrics.json").write_text("{}")
    hashed = hash_output(out, settings, volatile=())
    with open_store() as store, store.transaction() as tx:
        tx.add(Artifact(name="pretrain/out", artifact_type="folder", uri=str(out), content_hash=hashed["content_hash"]))
    before = os.stat(state)
    state.write_bytes(b"weights-1")
    os.utime(state, ns=(before.st_atime_ns, before.st_mtime_ns))
    said = run_cli("lineage", "verify")
    assert said.returncode == 1 and "content changed" in said.stdout, said.stdout
    assert "checkpoint/state.pt content changed" in said.stdout and "metrics.json" not in said.stdout, said.stdout

    # what `openlab wandb sync` writes into an output (its run folder marked synced) and a metric logged
    # again are no tampering: verify said they were, after every successful sync
    state.write_bytes(b"weights-0")
    (out / "wandb" / "offline-run-1").mkdir(parents=True)
    (out / "wandb" / "offline-run-1" / "run-1.wandb.synced").write_text("")
    (out / "metrics.json").write_text('{"loss": 2.0}')
    clean = run_cli("lineage", "verify")
    assert clean.returncode == 0, clean.stdout + clean.stderr


def test_show_lists_what_each_change_to_a_record_changed(run_cli, openlab_home: Path) -> None:
    """A failed run rewritten as completed through the store, after it ended, passes verify: the log holds
    the change. But `lineage show` said only "history 3 event(s), last 1a66…": what each event changed,
    and when, is what an auditor reads to see a failure turned into a success."""
    with open_store() as store:
        with store.transaction() as tx:
            run = tx.add(PipelineRun(name="r", recipe="r", replica="tiny", state="RUNNING"))
        with store.transaction() as tx:
            tx.update(run, state="FAILED", error="pretrain: exit 3")
        with store.transaction() as tx:
            tx.update(run, state="COMPLETED", error=None)
    shown = run_cli("lineage", "show", run.id)
    assert shown.returncode == 0, shown.stderr
    history = shown.stdout.split("history 3 event(s)\n", 1)[1].splitlines()
    assert history[0].endswith("  create"), history
    assert history[1].endswith("update  error: None -> 'pretrain: exit 3'; state: 'RUNNING' -> 'FAILED'"), history
    assert history[2].endswith("update  error: 'pretrain: exit 3' -> None; state: 'FAILED' -> 'COMPLETED'"), history
    events = json.loads(run_cli("lineage", "show", run.id, "--json").stdout)["events"]
    assert events[2]["changed"] == [
        {"field": "error", "old": "pretrain: exit 3", "new": None},
        {"field": "state", "old": "FAILED", "new": "COMPLETED"},
    ]
    assert history[3].startswith(f"  last {events[2]['seq']}:{events[2]['hash']}"), history
