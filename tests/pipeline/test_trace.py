"""`openlab lineage trace`: the transitive lineage of a record, up (what it came from) and down (what came from it).

A real toy pipeline (gen -> upper -> count, local jobs, real git, SQLite) is recorded, then traced
through the CLI as an auditor would, from the last stage's output and from the first stage's data.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from orchestrator.lineage.models import StageRun
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline import RunOptions, run_pipeline
from tests.pipeline.toy import git, make_repo, toy_configs, toy_pipeline


def _nodes(tree: dict[str, Any]) -> list[dict[str, Any]]:
    return [tree, *(n for child in tree["children"] for n in _nodes(child))]


@pytest.fixture
def recorded(tmp_path: Path) -> dict[str, Any]:
    repo = make_repo(tmp_path)
    result = run_pipeline(toy_pipeline(repo), toy_configs(), options=RunOptions(wait_poll=0.05, lease_ttl=10))
    assert result.ok, result.error
    with LineageStore.open() as store:
        stages = {s.stage: s for s in store.list(StageRun, pipeline_run_id=result.pipeline_run.id)}
    return {
        "repo": repo,
        "run": result.pipeline_run.id,
        "stages": stages,
        "sha": git(repo, "rev-parse", "HEAD").strip(),
    }


def test_trace_up_from_the_last_output_reaches_every_stage_its_jobs_data_and_commit(run_cli, recorded) -> None:
    count = recorded["stages"]["count"]
    artifact_id = count.outputs["out"]["artifact_id"]
    done = run_cli("lineage", "trace", artifact_id, "--json")
    assert done.returncode == 0, done.stderr
    tree = json.loads(done.stdout)
    nodes = _nodes(tree)
    assert (tree["kind"], tree["id"]) == ("artifact", artifact_id)
    assert tree["children"][0]["relation"] == "wasGeneratedBy" and tree["children"][0]["id"] == count.id
    reached = {n["id"] for n in nodes if not n.get("repeated")}
    assert {s.id for s in recorded["stages"].values()} <= reached, "every upstream stage run"
    gen_output = recorded["stages"]["gen"].outputs["out"]
    assert gen_output["artifact_id"] in reached and gen_output["snapshot_id"] in reached, (
        "the data, as artifact and snapshot"
    )
    commits = [n for n in nodes if n["kind"] == "commit"]
    assert commits and all(n["id"].startswith(recorded["sha"]) and "toy stages" in n["summary"] for n in commits)
    assert sum(1 for n in commits if not n.get("repeated")) == 1, "one commit, expanded once"
    jobs = [n for n in nodes if n.get("relation") == "ranAs"]
    where = f" local@{os.uname().nodename} job=local-"  # which job, on which cluster (for local: this host)
    assert len(jobs) == 3 and all(n["kind"] == "attempt" and where in n["summary"] for n in jobs)
    assert any(n.get("relation") == "partOf" and n["id"] == recorded["run"] for n in nodes)

    shallow = json.loads(run_cli("lineage", "trace", artifact_id, "--json", "--depth", "1").stdout)
    assert [c["id"] for c in shallow["children"]] == [count.id]
    assert shallow["children"][0]["truncated"] is True and shallow["children"][0]["children"] == []

    human = run_cli("lineage", "trace", artifact_id[:12])
    assert human.returncode == 0, human.stderr
    assert f"wasGeneratedBy stage_run {count.id} count COMPLETED" in human.stdout
    repeats = [line for line in human.stdout.splitlines() if line.endswith("(shown above)")]
    assert repeats, "a record met twice is expanded once"
    commit_line = f"commit {commits[0]['id']} (shown above)"  # the id, not the commit's message again
    assert any(line.endswith(commit_line) for line in repeats), repeats


def test_trace_down_from_the_data_reaches_everything_made_from_it(run_cli, recorded) -> None:
    """The question after a bad-data finding: which outputs were made from this snapshot?"""
    snapshot_id = recorded["stages"]["gen"].outputs["out"]["snapshot_id"]
    done = run_cli("lineage", "trace", snapshot_id, "--down", "--json")
    assert done.returncode == 0, done.stderr
    nodes = _nodes(json.loads(done.stdout))
    reached = {n["id"] for n in nodes}
    for stage in ("upper", "count"):
        out = recorded["stages"][stage].outputs["out"]
        assert recorded["stages"][stage].id in reached and out["artifact_id"] in reached, stage
    assert not any(n["kind"] == "commit" for n in nodes), "down never climbs back up to the inputs' causes"


def test_trace_of_an_unknown_id_is_one_line(run_cli, recorded) -> None:
    done = run_cli("lineage", "trace", "art_nosuchthing")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: no lineage record with id 'art_nosuchthing'; `openlab lineage list` shows ids"
    ]


def _json(dot: str, graph: str) -> str:
    done = subprocess.run([dot, "-Tjson"], input=graph, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _rendered(dot: str, graph: str) -> tuple[set[str], set[tuple[str, str, str]]]:
    """The records and arrows of a DOT graph, as graphviz itself reads them (``dot -Tjson``)."""
    done = subprocess.run([dot, "-Tjson"], input=graph, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    name = {o["_gvid"]: o["name"] for o in doc["objects"]}
    return set(name.values()), {(name[e["tail"]], name[e["head"]], e["label"]) for e in doc.get("edges", [])}


def test_trace_as_a_graph_draws_each_record_once_with_prov_arrows_and_renders(run_cli, recorded) -> None:
    """`lineage trace ID --dot | dot -Tsvg`: the picture of a lineage for a report. Graphviz reads
    it; each record is one node however often the walk met it; arrows point from the later record
    to the earlier one it names, as PROV draws them, both up and down."""
    from tests.services import require_graphviz

    dot = require_graphviz()
    count, upper, gen = (recorded["stages"][s] for s in ("count", "upper", "gen"))
    artifact_id = count.outputs["out"]["artifact_id"]
    tree = json.loads(run_cli("lineage", "trace", artifact_id, "--json").stdout)
    graph = run_cli("lineage", "trace", artifact_id, "--dot")
    assert graph.returncode == 0, graph.stderr
    nodes, arrows = _rendered(dot, graph.stdout)
    assert nodes == {n["id"] for n in _nodes(tree)}, "every record the trace reached, once"
    assert len(graph.stdout.splitlines()) == 4 + len(nodes) + len(arrows) + 1, "no node or arrow drawn twice"
    assert (artifact_id, count.id, "wasGeneratedBy") in arrows
    upper_out = upper.outputs["out"]["artifact_id"]
    assert any(a[:2] == (count.id, upper_out) and a[2].startswith("used") for a in arrows), arrows
    assert (count.id, recorded["sha"], "wasAssociatedWith (code)") in arrows
    assert not {(b, a) for a, b, _ in arrows} & {(a, b) for a, b, _ in arrows}, "no pair drawn both ways"
    shapes = {o["name"]: o.get("shape") for o in json.loads(_json(dot, graph.stdout))["objects"]}
    # by PROV class, as `lineage export -f prov` types them: a commit is an entity (an ellipse), not an agent
    assert shapes[recorded["sha"]] == "ellipse" and shapes[artifact_id] == "ellipse", shapes
    assert shapes[count.id] == "box", shapes
    svg = subprocess.run([dot, "-Tsvg"], input=graph.stdout, capture_output=True, text=True, timeout=60)
    assert svg.returncode == 0 and "<svg" in svg.stdout and "count COMPLETED" in svg.stdout, svg.stderr

    # down from the data: the same direction of arrows, from what was made to what it was made from
    snapshot_id = gen.outputs["out"]["snapshot_id"]
    down_nodes, down_arrows = _rendered(dot, run_cli("lineage", "trace", snapshot_id, "--down", "--dot").stdout)
    assert {upper.id, count.id, artifact_id} <= down_nodes
    assert (artifact_id, count.id, "wasGeneratedBy") in down_arrows, down_arrows
    assert all(b != artifact_id for _, b, _ in down_arrows), "nothing was made from the last output"

    # cut short with --depth: where the picture stops, the border is dashed
    shallow = run_cli("lineage", "trace", artifact_id, "--dot", "--depth", "1").stdout
    done = subprocess.run([dot, "-Tjson"], input=shallow, capture_output=True, text=True, timeout=60)
    styles = {o["name"]: o.get("style", "") for o in json.loads(done.stdout)["objects"]}
    assert styles == {artifact_id: "filled", count.id: "filled,dashed"}, styles

    both = run_cli("lineage", "trace", artifact_id, "--dot", "--json")
    assert both.returncode == 2 and both.stderr.strip() == "error: give --json or --dot, not both"
