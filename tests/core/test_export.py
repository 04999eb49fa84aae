"""Lineage exports: PROV-JSON read back by the W3C ``prov`` library, OpenLineage events by field.

The lineage comes from a real run of the toy pipeline (git repo, local launcher, SQLite;
see tests/pipeline/toy.py), so the export is checked against what the pipeline recorded,
not against hand-made rows.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from prov.model import (
    ProvActivity,
    ProvAgent,
    ProvAssociation,
    ProvDocument,
    ProvEntity,
    ProvGeneration,
    ProvStart,
    ProvUsage,
)

from orchestrator.lineage.export import collect, export, run_uuid
from orchestrator.lineage.models import Relation, StageRun, utcnow
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline import RunOptions, run_pipeline
from orchestrator.provenance.invocation import command_line
from orchestrator.settings import load_settings
from tests.pipeline.toy import make_repo, toy_configs, toy_pipeline

SECRET = "s3cr3t-value-that-must-not-leak"


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Run the toy pipeline twice (the second reuses every stage); return both run ids."""
    monkeypatch.setenv("TOY_LEDGER", str(tmp_path / "ledger.txt"))
    monkeypatch.setenv("OPENLAB_TEST_API_TOKEN", SECRET)
    monkeypatch.setenv("LOGNAME", "ada")  # the login account that starts the runs (getpass reads it first)
    repo = make_repo(tmp_path)
    params = {"wandb_api_key": SECRET, "note": "nightly", "max_tokens": "4096", "tokenizer": "bpe-4096"}
    # what `openlab run` records of its own command line, a secret given as an option included
    command = command_line(["run", "toy", "--wandb-key", SECRET])
    options = RunOptions(wait_poll=0.05, lease_ttl=10, params=params, command=command)
    first = run_pipeline(toy_pipeline(repo), toy_configs(), options=options)
    second = run_pipeline(toy_pipeline(repo), toy_configs(), options=RunOptions(wait_poll=0.05, lease_ttl=10))
    assert first.ok and second.ok, (first.error, second.error)
    return {"first": first.pipeline_run.id, "second": second.pipeline_run.id}


def _store() -> LineageStore:
    return LineageStore.open(load_settings())


def test_prov_export_reads_back_with_one_prov_record_per_lineage_record(recorded: dict[str, str]) -> None:
    with _store() as store:
        text = export(store, "prov", [recorded["first"]])
        closure = collect(store, [recorded["first"]])
        stages = store.list(StageRun, pipeline_run_id=recorded["first"])
    doc = ProvDocument.deserialize(content=text, format="json")

    by_id = {str(rec.identifier).split(":", 1)[1]: rec for rec in doc.get_records() if rec.identifier}
    for record_id, record in closure.records.items():
        expected = {"entity": ProvEntity, "activity": ProvActivity, "agent": ProvAgent}[record.prov_type]
        assert isinstance(by_id[record_id], expected), (record.kind, record_id)
    assert {s.stage for s in stages} == {"gen", "upper", "count"}

    # Every stored relation is the PROV relation of the same name, one to one.
    def count(kind: type) -> int:
        return len(list(doc.get_records(kind)))

    rels = closure.relations
    assert count(ProvUsage) == sum(r.relation == "used" for r in rels) > 0
    assert count(ProvGeneration) == sum(r.relation == "wasGeneratedBy" for r in rels) > 0
    assert count(ProvAssociation) >= sum(r.relation == "wasAssociatedWith" for r in rels) > 0
    # The pipeline run started each stage run (a foreign key in the store, wasStartedBy in PROV).
    starts = {(str(s.formal_attributes[0][1]), str(s.formal_attributes[2][1])) for s in doc.get_records(ProvStart)}
    for stage in stages:
        assert (f"openlab:{stage.id}", f"openlab:{recorded['first']}") in starts

    # The `upper` stage used exactly what `gen` generated: the graph connects across stages.
    gen = next(s for s in stages if s.stage == "gen")
    upper = next(s for s in stages if s.stage == "upper")
    generated_by_gen = {
        str(g.formal_attributes[0][1])
        for g in doc.get_records(ProvGeneration)
        if str(g.formal_attributes[1][1]) == f"openlab:{gen.id}"
    }
    used_by_upper = {
        str(u.formal_attributes[1][1])
        for u in doc.get_records(ProvUsage)
        if str(u.formal_attributes[0][1]) == f"openlab:{upper.id}"
    }
    assert generated_by_gen & used_by_upper

    # By whom: the login account that started the run, and submitted each job, is a PROV agent.
    ada = by_id["account-ada"]
    assert isinstance(ada, ProvAgent) and "ada" in {str(v) for v in ada.get_attribute("prov:label")}
    associated = {
        (str(a.formal_attributes[0][1]), str(a.formal_attributes[1][1]), str(next(iter(a.get_attribute("prov:role")))))
        for a in doc.get_records(ProvAssociation)
        if a.get_attribute("prov:role")
    }
    assert (f"openlab:{recorded['first']}", "openlab:account-ada", "started-by") in associated
    attempts = [r for r in closure.records.values() if r.kind == "attempt"]
    assert attempts and all((f"openlab:{a.id}", "openlab:account-ada", "submitted-by") in associated for a in attempts)

    # Activities carry their times; round-tripping through the library loses nothing.
    activity = by_id[upper.id]
    assert activity.get_startTime() is not None and activity.get_endTime() is not None
    again = ProvDocument.deserialize(content=doc.serialize(format="json"), format="json")
    assert again == doc


def test_openlineage_events_pair_start_and_end_and_link_stages_through_datasets(recorded: dict[str, str]) -> None:
    with _store() as store:
        lines = export(store, "openlineage", [recorded["first"]]).splitlines()
        stages = {s.stage: s for s in store.list(StageRun, pipeline_run_id=recorded["first"])}
    events = [json.loads(line) for line in lines]

    pipeline_uuid = run_uuid(recorded["first"])
    for event in events:
        assert {"eventType", "eventTime", "run", "job", "producer", "schemaURL"} <= event.keys()
        assert event["eventType"] in {"START", "COMPLETE", "ABORT", "FAIL", "OTHER"}
        uuid.UUID(event["run"]["runId"])  # the spec says uuid
        assert event["job"]["namespace"] == "openlab" and event["job"]["name"]
        for facets in (event["run"].get("facets", {}), event["job"].get("facets", {})):
            for name, facet in facets.items():
                assert facet["_producer"] and facet["_schemaURL"], name
    times = [e["eventTime"] for e in events]
    assert times == sorted(times)

    per_run: dict[str, list[str]] = {}
    for event in events:
        per_run.setdefault(event["run"]["runId"], []).append(event["eventType"])
    assert per_run[pipeline_uuid] == ["START", "COMPLETE"]
    for stage in stages.values():
        assert per_run[run_uuid(stage.id)] == ["START", "COMPLETE"]

    done = {e["job"]["name"].rsplit(".", 1)[-1]: e for e in events if e["eventType"] == "COMPLETE"}
    upper = done["upper"]
    assert upper["run"]["facets"]["parent"]["run"]["runId"] == pipeline_uuid
    assert upper["run"]["facets"]["openlab"]["identity"] == stages["upper"].identity
    assert upper["run"]["facets"]["openlab"]["attempts"][0]["backend"] == "local"
    code = upper["job"]["facets"]["sourceCodeLocation"]
    assert code["version"] and code["url"].startswith("file:///")  # the commit sha; a URI, as the spec says
    params = done["toy"]["run"]["facets"]["openlab"]["params"]
    assert params["max_tokens"] == "4096" and params["tokenizer"] == "bpe-4096"  # shapes are not secrets
    assert params["wandb_api_key"] == "***"
    facet = done["toy"]["run"]["facets"]["openlab"]
    assert (facet["user"], facet["trigger"]) == ("ada", "terminal")
    assert facet["command"] == ["openlab", "run", "toy", "--wandb-key", "***"], "a secret option's value is masked"
    # A lineage server joins jobs on dataset (namespace, name): gen's output is upper's input.
    gen_out = {(d["namespace"], d["name"], d["facets"]["version"]["datasetVersion"]) for d in done["gen"]["outputs"]}
    upper_in = {(d["namespace"], d["name"], d["facets"]["version"]["datasetVersion"]) for d in upper["inputs"]}
    assert gen_out & upper_in


def test_failed_stage_exports_fail_with_its_error_and_secrets_never_leave(recorded: dict[str, str]) -> None:
    with _store() as store:
        stage = next(s for s in store.list(StageRun, pipeline_run_id=recorded["first"]) if s.stage == "count")
        with store.transaction() as tx:  # as if the job had died printing the token
            tx.update(tx.get(StageRun, stage.id), state="FAILED", error=f"auth failed with {SECRET}", ended_at=utcnow())
        prov_text = export(store, "prov", [recorded["first"]])
        ol_text = export(store, "openlineage")
    for text in (prov_text, ol_text):
        assert SECRET not in text
    events = [json.loads(line) for line in ol_text.splitlines()]
    fail = [e for e in events if e["run"]["runId"] == run_uuid(stage.id) and e["eventType"] == "FAIL"]
    assert len(fail) == 1
    assert fail[0]["run"]["facets"]["errorMessage"]["message"] == "auth failed with ***"
    # Exporting everything covers both pipeline runs; the second one's stages were reused.
    assert {run_uuid(recorded["first"]), run_uuid(recorded["second"])} <= {e["run"]["runId"] for e in events}


def test_cli_export_writes_file_and_rejects_bad_input(recorded: dict[str, str], run_cli, tmp_path: Path) -> None:
    out = tmp_path / "exports" / "run.prov.json"
    done = run_cli("lineage", "export", recorded["first"][:12], "--format", "prov", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["prefix"]["openlab"] == "urn:openlab:"
    # `-o -` is stdout, as a script piping the export on writes it: not a file named "-" where it ran
    piped = run_cli("lineage", "export", recorded["first"][:12], "-o", "-", cwd=tmp_path)
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout) == json.loads(out.read_text()) and not (tmp_path / "-").exists()
    folder = run_cli("lineage", "export", recorded["first"][:12], "-o", str(tmp_path))
    assert (
        folder.returncode == 2
        and folder.stderr == f"error: --output {tmp_path} is a folder: give a file to write (prov is one file)\n"
    )
    denied = run_cli("lineage", "export", recorded["first"][:12], "-o", "/proc/openlab/x.json")
    assert denied.returncode == 2 and denied.stderr.startswith("error: cannot write /proc/openlab/x.json: "), (
        denied.stderr
    )
    crate = run_cli("lineage", "export", recorded["first"][:12], "-f", "ro-crate", "-o", "-", cwd=tmp_path)
    assert crate.returncode == 2 and "add --output DIR" in crate.stderr and not (tmp_path / "-").exists()


def test_export_into_a_pipe_or_device_writes_into_it_and_leaves_it_one(
    recorded: dict[str, str], run_cli, tmp_path: Path
) -> None:
    """``-o /dev/null``, ``-o /dev/stdout``, a named pipe: the export was written beside it and renamed over
    it, so root's /dev/null became a regular file holding the export (and a pipe's reader got nothing)."""
    import stat
    import threading

    (tmp_path / "out").mkdir()
    pipe = tmp_path / "out" / "export.pipe"
    os.mkfifo(pipe)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(pipe.read_bytes()), daemon=True)
    reader.start()
    done = run_cli("lineage", "export", recorded["first"][:12], "--format", "prov", "-o", str(pipe), timeout=60)
    reader.join(timeout=30)
    assert done.returncode == 0, done.stderr
    assert got and json.loads(got[0])["prefix"]["openlab"] == "urn:openlab:", "the pipe's reader got the export"
    assert stat.S_ISFIFO(pipe.stat().st_mode), "still a pipe, not a file put in its place"
    assert [p.name for p in pipe.parent.iterdir()] == ["export.pipe"], "no temporary file left beside it"

    done = run_cli("lineage", "export", "--format", "rdf")
    assert done.returncode == 2
    assert "unknown export format 'rdf'" in done.stderr and "Traceback" not in done.stderr
    assert "prov, openlineage, ro-crate" in done.stderr  # every format the command writes is offered

    with _store() as store:
        stage_id = store.list(StageRun, pipeline_run_id=recorded["first"])[0].id
        assert store.list(Relation)  # sanity: the run recorded relations
    done = run_cli("lineage", "export", stage_id, "-o", str(tmp_path / "nope.json"))
    assert done.returncode == 2 and "not a pipeline run" in done.stderr
    assert not (tmp_path / "nope.json").exists()


def test_ro_crate_reads_back_as_a_workflow_run_with_each_stage_linked(
    recorded: dict[str, str], run_cli, tmp_path: Path
) -> None:
    """`openlab lineage export -f ro-crate -o DIR` writes a Provenance Run Crate that the `rocrate`
    library reads: the pipeline is the main workflow, each run a CreateAction, each stage run a
    CreateAction worked by its step's tool, whose inputs are what the upstream stage produced."""
    import warnings

    from rocrate.rocrate import ROCrate

    crate_dir = tmp_path / "crate"
    done = run_cli("lineage", "export", recorded["first"], recorded["second"], "-f", "ro-crate", "-o", str(crate_dir))
    assert done.returncode == 0, done.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the library warns on what the spec asks for, e.g. data outside hasPart
        crate = ROCrate(crate_dir)
    profiles = {c.id for c in crate.root_dataset["conformsTo"]}
    assert "https://w3id.org/ro/wfrun/provenance/0.5" in profiles
    workflow = crate.mainEntity
    assert workflow.id == "workflow/toy.json" and (crate_dir / "workflow" / "toy.json").is_file()
    assert "ComputationalWorkflow" in workflow.type
    assert [s["name"] for s in sorted(workflow["step"], key=lambda s: int(s["position"]))] == ["gen", "upper", "count"]
    described = json.loads((crate_dir / "workflow" / "toy.json").read_text())
    assert [s["name"] for s in described["stages"]] == ["gen", "upper", "count"]

    with _store() as store:
        stages = {s.stage: s for s in store.list(StageRun, pipeline_run_id=recorded["first"])}
    runs = {a.id: a for a in crate.get_by_type("CreateAction")}
    first = runs[f"#{recorded['first']}"]
    assert first["instrument"].id == workflow.id
    status = first["actionStatus"]
    assert getattr(status, "id", status) == "http://schema.org/CompletedActionStatus"
    assert {c.type for c in first["object"]} >= {"SoftwareSourceCode"}  # the commit it ran
    assert (first["agent"].type, first["agent"]["name"]) == ("Person", "ada"), "who started it"
    assert "command: openlab run toy --wandb-key '***'" in first["description"], first["description"]
    upper = runs[f"#{stages['upper'].id}"]
    gen = runs[f"#{stages['gen'].id}"]
    assert upper["instrument"].id == "#tool-upper"
    assert {e.id for e in upper["object"]} & {e.id for e in gen["result"]}, "upper used what gen produced"
    assert all(e.id.startswith("file://") and e["identifier"] for e in gen["result"] if e.type != "PropertyValue")
    here = os.uname().nodename  # which job on which machine: a local job's cluster is this host
    jobs = [p for p in upper["identifier"] if p.type == "PropertyValue" and p["name"] == f"local job on {here}"]
    assert jobs and jobs[0]["value"] and "COMPLETED" in jobs[0]["description"]
    # what each run was asked (its settings: the workflow's inputs) and what each stage measured (its
    # tool's outputs), each a PropertyValue that is an example of its FormalParameter, secrets masked
    settings = {p["name"]: p["value"] for p in first["object"] if p.type == "PropertyValue"}
    assert settings == {
        "backend": "local",
        "force": False,
        "max_tokens": "4096",
        "note": "nightly",
        "tokenizer": "bpe-4096",
        "wandb_api_key": "***",
    }, settings
    assert {i.id for i in workflow["input"]} == {f"#param-{key}" for key in settings}
    assert all(i.type == "FormalParameter" for i in workflow["input"])
    count = runs[f"#{stages['count'].id}"]
    measured = {p["name"]: p for p in count["result"] if p.type == "PropertyValue"}
    assert measured["eval/loss"]["value"] == 1.5 and measured["words"]["value"] == stages["count"].metrics["words"]
    tool = crate.dereference("#tool-count")
    assert {p["exampleOfWork"].id for p in measured.values()} == {o.id for o in tool["output"]}
    # the second run reused every stage, and says so; a reused stage's results are those it took
    second_stages = [a for a in runs.values() if "reused" in str(a.get("name"))]
    assert len(second_stages) == 3
    (reused_count,) = [a for a in second_stages if a["instrument"].id == "#tool-count"]
    assert {p["name"]: p["value"] for p in reused_count["result"] if p.type == "PropertyValue"} == {
        name: p["value"] for name, p in measured.items()
    }
    controls = crate.get_by_type("ControlAction")
    assert {c["instrument"].id for c in controls} == {"#step-gen", "#step-upper", "#step-count"}
    organize = crate.get_by_type("OrganizeAction")
    assert {o["result"].id for o in organize} == {f"#{recorded['first']}", f"#{recorded['second']}"}

    text = (crate_dir / "ro-crate-metadata.json").read_text()
    assert SECRET not in text  # the run's params held a secret-named value and a secret env value

    # Bad input: one line, nothing written.
    done = run_cli("lineage", "export", "-f", "ro-crate")
    assert done.returncode == 2 and "add --output DIR" in done.stderr and "Traceback" not in done.stderr
    done = run_cli("lineage", "export", "-f", "ro-crate", "-o", str(crate_dir))
    assert done.returncode == 2 and "not an empty directory" in done.stderr


def test_a_sweeps_runs_have_the_sweep_as_their_openlineage_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipeline run of a sweep names the sweep as its parent run (one id for all its runs), so
    Marquez shows the sweep's runs together; a run of no sweep has no parent."""
    from orchestrator.pipeline.sweep import sweep_params

    monkeypatch.setenv("TOY_LEDGER", str(tmp_path / "ledger.txt"))
    repo = make_repo(tmp_path)
    options = RunOptions(wait_poll=0.05, lease_ttl=10, params={"sweep": sweep_params("swp_" + "7" * 20, 1, 2)})
    swept = run_pipeline(toy_pipeline(repo), toy_configs(), options=options)
    alone = run_pipeline(toy_pipeline(repo), toy_configs(), options=RunOptions(wait_poll=0.05, lease_ttl=10))
    with _store() as store:
        events = [
            json.loads(x)
            for x in export(store, "openlineage", [swept.pipeline_run.id, alone.pipeline_run.id]).splitlines()
        ]
    runs = {e["run"]["runId"]: e for e in events if e["job"]["facets"]["jobType"]["jobType"] == "PIPELINE"}
    parent = runs[run_uuid(swept.pipeline_run.id)]["run"]["facets"]["parent"]
    assert parent["run"]["runId"] == run_uuid("swp_" + "7" * 20) and parent["job"]["name"] == "toy.sweep", parent
    assert "parent" not in runs[run_uuid(alone.pipeline_run.id)]["run"]["facets"]


def test_a_diverged_loss_exports_as_strict_json_and_an_odd_name_stays_in_the_crate(
    recorded: dict[str, str], run_cli, tmp_path: Path
) -> None:
    """A loss that went to NaN reached OpenLineage, the RO-Crate and `--json` as a bare `NaN`, which no
    strict reader takes; and a pipeline named `../x` wrote its workflow file outside the crate."""

    def strict(text: str) -> object:
        def refuse(name: str) -> None:
            raise ValueError(f"bare {name}")

        return json.loads(text, parse_constant=refuse)

    from orchestrator.lineage.models import PipelineRun

    with _store() as store:
        (stage, *_) = store.list(StageRun, pipeline_run_id=recorded["first"])
        run = store.require(PipelineRun, recorded["first"])
        with store.transaction() as tx:
            tx.update(stage, metrics={"loss": float("nan"), "grad_norm": float("inf")})
            tx.update(run, recipe="../../escaped")
        for fmt in ("prov", "openlineage"):
            text = export(store, fmt, [recorded["first"]])
            for line in [text] if fmt == "prov" else text.splitlines():
                strict(line)
        assert '"NaN"' in text and '"Infinity"' in text, "the values kept, as text"
    shown = run_cli("lineage", "show", stage.id, "--json")
    assert shown.returncode == 0 and strict(shown.stdout)
    crate_dir = tmp_path / "deep" / "crate"
    done = run_cli("lineage", "export", recorded["first"], "-f", "ro-crate", "-o", str(crate_dir))
    assert done.returncode == 0, done.stderr
    document = strict((crate_dir / "ro-crate-metadata.json").read_text())
    assert [p.name for p in (crate_dir / "workflow").iterdir()] == ["-..-escaped.json"]
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["crate"], "nothing written beside the crate"
    assert any(e["@id"] == "workflow/-..-escaped.json" for e in document["@graph"])  # type: ignore[index]


def test_an_unresolved_issue_has_an_id_that_is_an_iri_in_the_crate(tmp_path: Path) -> None:
    """An issue GitHub was not asked about yet has no URL: its local id was `#issue-lab/exp#12`, two
    fragments in one reference, which no IRI parser takes."""
    import urllib.parse

    from orchestrator.lineage.models import GithubIssue, PipelineRun
    from orchestrator.lineage.rocrate import to_rocrate

    with LineageStore(f"sqlite:///{tmp_path / 'l.db'}") as store:
        with store.transaction() as tx:
            run = tx.add(PipelineRun(recipe="marin-535b-a23b", replica="tiny", state="COMPLETED"))
            issue = tx.add(GithubIssue(id="lab/exp#12", repo="lab/exp", number=12))
            tx.relate("wasAssociatedWith", run, issue, role="experiment")
        document, _ = to_rocrate(collect(store, [run.id]))
    (entity,) = [e for e in document["@graph"] if e.get("identifier") == "lab/exp#12"]
    assert entity["@id"] == "#issue-lab/exp%2312", entity
    assert urllib.parse.urlsplit(entity["@id"]).fragment == "issue-lab/exp%2312"
