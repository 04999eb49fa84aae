"""Export pipeline runs as a Workflow Run RO-Crate (Provenance Run Crate profile 0.5).

Why a third format: PROV-JSON is for provenance tools and OpenLineage for lineage servers;
RO-Crate is what research repositories (Zenodo, WorkflowHub) and the workflow-run community
read, and no peer system writes one (see ``peers.md``). A crate is a directory:

- ``ro-crate-metadata.json``: the JSON-LD graph.
- ``workflow/<pipeline>.json``: the pipeline as lineage recorded it (stages in order, each
  with its upstream stages, declared code paths and recipe), the crate's ``mainEntity``.

The graph follows https://w3id.org/ro/wfrun/provenance/0.5: the pipeline is a
``ComputationalWorkflow`` whose ``step``\\s are ``HowToStep``\\s, each worked by a tool; each
pipeline run is a ``CreateAction`` (instrument: the workflow) and each stage run one too
(instrument: its stage's tool); an ``OrganizeAction`` per pipeline run is openlab's own run,
with one ``ControlAction`` per stage linking step to stage run. Stage inputs (``object``) and
outputs (``result``) are the snapshots and artifacts lineage hashed, named by their file URIs
with their content hash as ``identifier`` (a reused stage's are those of the stage run whose
outputs it took, in an earlier run: so a later stage's input is always some action's result);
the commit is an input of the pipeline run (a dirty tree's patch, where this openlab home has
it, a ``File`` part of it), the
GitHub issue and W&B runs are what the runs are ``subjectOf``, and backend jobs (Slurm job id,
container, Kubernetes Job, host, exit code) are ``identifier`` property values of their stage
run. What a run was asked (its replica, backend, parameters and each value it set over its recipe)
is a ``PropertyValue`` in its ``object``, and what a stage measured (its metrics, flattened) one in
its ``result``, each the ``exampleOfWork`` of a ``FormalParameter``: the workflow's ``input`` and
the stage tool's ``output``, as the profile models parameters. Values pass through the same
secret masking as every other export.

One crate describes one workflow, so the runs exported together must be of one pipeline.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shlex
import shutil
import tempfile
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.lineage.diff import flatten_metrics
from orchestrator.lineage.export import (
    Closure,
    ExportError,
    account_id,
    clean_value,
    collect,
    dumps,
    iso_time,
    patch_files,
    producer_uri,
)
from orchestrator.lineage.models import Attempt, PipelineRun, StageRun
from orchestrator.lineage.store import LineageStore
from orchestrator.secrets import scrub, secret_values

RO_CRATE = "https://w3id.org/ro/crate/1.1"
FORMAL_PARAMETER = "https://bioschemas.org/profiles/FormalParameter/1.0-RELEASE"
#: Run parameters that are openlab's bookkeeping, not a setting of the experiment (the recipe itself
#: is the workflow file; where the code was checked out is the commit's business).
_NOT_SETTINGS = frozenset({"pipeline", "repo_root", "recipe", "image_code", "image_code_by_backend", "retry_of"})
PROFILES = [f"https://w3id.org/ro/wfrun/{name}/0.5" for name in ("process", "workflow", "provenance")]
WORKFLOW_PROFILE = "https://w3id.org/workflowhub/workflow-ro-crate/1.0"

_STATUS = {
    "COMPLETED": "http://schema.org/CompletedActionStatus",
    "REUSED": "http://schema.org/CompletedActionStatus",
    "FAILED": "http://schema.org/FailedActionStatus",
    "LOST": "http://schema.org/FailedActionStatus",
    "CANCELLED": "http://schema.org/FailedActionStatus",
    "PREEMPTED": "http://schema.org/FailedActionStatus",
    "RUNNING": "http://schema.org/ActiveActionStatus",
    "PENDING": "http://schema.org/PotentialActionStatus",
}


def _fragment(*parts: str) -> str:
    """A local ``@id`` from ``parts`` (a metric's slashes kept, anything else odd escaped)."""
    return "#" + "-".join(urllib.parse.quote(part, safe="/_.") for part in parts)


def _dirty_text(commit: Any) -> str | None:
    """What a commit record's tree had beside the commit: its patch, or what no patch holds."""
    if commit.patch_hash:
        return f"uncommitted changes: patch {commit.patch_hash}"
    if commit.dirty:  # an untracked file too large for a patch, a nested repository with no commit
        return "uncommitted changes no patch holds: an untracked file too large for one, or a repository with no commit"
    return None


def _value_type(value: Any) -> str:
    """The schema.org type a formal parameter's values have."""
    if isinstance(value, bool):
        return "Boolean"
    if isinstance(value, int):
        return "Integer"
    if isinstance(value, float):
        return "Float"
    return "Text"


def _plain(value: Any) -> Any:
    """A property value: a scalar as it is, anything else as its JSON."""
    return value if isinstance(value, (str, int, float, bool)) else json.dumps(value, sort_keys=True)


def run_settings(run: PipelineRun, secrets: Sequence[str]) -> dict[str, Any]:
    """What a run was asked to do beyond its recipe, as name -> value: its replica and backend, each
    value it set over the recipe (``set KEY``: ``openlab run --set``, the form's overrides) and each
    parameter it was given, secrets masked."""
    settings: dict[str, Any] = {"replica": run.replica, "backend": run.backend}
    params = clean_value(dict(run.params or {}), secrets)
    for key, value in sorted(params.items()):
        if key not in _NOT_SETTINGS and value not in (None, [], {}) and not isinstance(value, Mapping):
            settings[key] = value
    for key, value in sorted(clean_value(run.run_set, secrets).items()):
        settings[f"set {key}"] = value
    return {k: v for k, v in settings.items() if v is not None}


def _ref(entity_id: str) -> dict[str, str]:
    return {"@id": entity_id}


def _unique(refs: list[dict[str, str]]) -> list[dict[str, str]]:
    return [r for i, r in enumerate(refs) if r not in refs[:i]]


def _pipeline_name(run: PipelineRun) -> str:
    return run.recipe or run.name or "pipeline"


def to_rocrate(closure: Closure) -> tuple[dict[str, Any], dict[str, str]]:
    """The crate for ``closure``: (metadata document, {relative path: text of a payload file})."""
    secrets = secret_values()
    pipelines = sorted((r for r in closure.records.values() if isinstance(r, PipelineRun)), key=lambda r: r.started_at)
    if not pipelines:
        raise ExportError("nothing to export: the lineage store has no pipeline runs")
    names = sorted({_pipeline_name(p) for p in pipelines})
    if len(names) > 1:
        raise ExportError(
            f"an RO-Crate describes one workflow, these runs are of {len(names)} ({', '.join(names)}); "
            "export the runs of one pipeline at a time (`openlab lineage list` shows run ids)"
        )
    name = names[0]
    run_ids = {p.id for p in pipelines}
    stages = sorted(
        (r for r in closure.records.values() if isinstance(r, StageRun) and r.pipeline_run_id in run_ids),
        key=lambda r: r.started_at,
    )
    patches = patch_files(closure)
    attempts: dict[str, list[Attempt]] = {}
    for record in closure.records.values():
        if isinstance(record, Attempt) and record.stage_run_id:
            attempts.setdefault(record.stage_run_id, []).append(record)

    graph: dict[str, dict[str, Any]] = {}

    def add(entity: dict[str, Any]) -> dict[str, str]:
        graph.setdefault(entity["@id"], {}).update({k: v for k, v in entity.items() if v not in (None, [], {})})
        return _ref(entity["@id"])

    # -- the workflow: stages in the order they ran, each with its upstream stages -------------
    order: list[str] = []
    upstream: dict[str, list[str]] = {}
    code_paths: dict[str, list[str]] = {}
    for stage in stages:
        if stage.stage not in order:
            order.append(stage.stage)
        fields = stage.identity_fields or {}
        upstream.setdefault(stage.stage, sorted((fields.get("inputs") or {}).keys()))
        code_paths.setdefault(stage.stage, sorted((fields.get("code") or {}).keys()))
    recipe = clean_value((pipelines[-1].params or {}).get("recipe"), secrets)
    # a file of the crate whatever the name holds (a pipeline built in code may be named anything:
    # "../x" wrote outside the crate), and an @id that is a relative IRI
    workflow_path = f"workflow/{re.sub(r'[^A-Za-z0-9_.-]+', '-', name).lstrip('.') or 'pipeline'}.json"
    workflow_text = (
        dumps(
            {
                "pipeline": name,
                "recipe": recipe,
                "stages": [{"name": s, "inputs": upstream[s], "code": code_paths[s]} for s in order],
            },
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    language = add({"@id": "#openlab-pipeline", "@type": "ComputerLanguage", "name": "openlab pipeline"})
    engine_version = producer_uri().rsplit(":", 1)[-1]
    engine = add(
        {"@id": "#openlab", "@type": "SoftwareApplication", "name": "openlab", "softwareVersion": engine_version}
    )
    steps, tools = [], []
    for position, stage_name in enumerate(order):
        tool = add({"@id": f"#tool-{stage_name}", "@type": "SoftwareApplication", "name": stage_name})
        tools.append(tool)
        steps.append(
            add(
                {
                    "@id": f"#step-{stage_name}",
                    "@type": "HowToStep",
                    "name": stage_name,
                    "position": str(position),
                    "workExample": tool,
                }
            )
        )
    workflow = add(
        {
            "@id": workflow_path,
            "@type": ["File", "SoftwareSourceCode", "ComputationalWorkflow", "HowTo"],
            "name": name,
            "encodingFormat": "application/json",
            "programmingLanguage": language,
            "step": steps,
            "hasPart": tools,
        }
    )

    # -- entities: snapshots and artifacts as file URIs (content hash as identifier); commit, issue, W&B run
    def entity_for(record_id: str) -> dict[str, str] | None:
        record = closure.records.get(record_id)
        if record is None:
            return None
        if record.kind == "snapshot":
            uri = Path(record.path).resolve().as_uri()  # type: ignore[attr-defined]
            return add(
                {
                    "@id": uri,
                    "@type": "Dataset",
                    "name": Path(record.path).name,  # type: ignore[attr-defined]
                    "identifier": record.id,
                    "contentSize": str(record.bytes),  # type: ignore[attr-defined]
                    "description": f"data snapshot of {record.files} files (Merkle root {record.id})",  # type: ignore[attr-defined]
                }
            )
        if record.kind == "artifact":
            uri = record.uri if "://" in record.uri else Path(record.uri).resolve().as_uri()  # type: ignore[attr-defined]
            return add(
                {
                    "@id": scrub(uri, secrets),
                    # a stage's output folder is a Dataset, as its snapshot (the same folder, the same @id) is
                    "@type": "Dataset" if record.artifact_type in ("folder", "directory") else "File",  # type: ignore[attr-defined]
                    "name": record.name,  # type: ignore[attr-defined]
                    "identifier": record.content_hash,  # type: ignore[attr-defined]
                    "contentSize": str(record.size),  # type: ignore[attr-defined]
                }
            )
        if record.kind == "commit":
            where = record.remote_url or record.repo_path  # type: ignore[attr-defined]
            patch = None
            if record.id in patches:  # the uncommitted changes, where this openlab home keeps them
                blob = patches[record.id]
                patch = add(
                    {
                        "@id": blob.resolve().as_uri(),
                        "@type": "File",
                        "name": f"uncommitted changes on {record.sha or 'no commit'}",  # type: ignore[attr-defined]
                        "encodingFormat": "text/x-diff",
                        "identifier": record.patch_hash,  # type: ignore[attr-defined]
                        "contentSize": str(blob.stat().st_size),
                        "description": f"`git apply --binary` it on {record.sha} to rebuild the tree that ran",  # type: ignore[attr-defined]
                    }
                )
            return add(
                {
                    "@id": f"#commit-{record.id}",
                    "@type": "SoftwareSourceCode",
                    "name": f"commit {record.sha or 'none'}{' (dirty)' if record.dirty else ''}",  # type: ignore[attr-defined]
                    "codeRepository": scrub(where, secrets) if where else None,
                    "version": record.sha,  # type: ignore[attr-defined]
                    "identifier": record.id,
                    "description": _dirty_text(record),
                    "hasPart": [patch] if patch else None,
                }
            )
        if record.kind == "github_issue":
            return add(
                {
                    "@id": record.url or _fragment("issue", record.id),  # type: ignore[attr-defined]
                    "@type": "CreativeWork",
                    "name": f"{record.id}: {record.title or ''}".rstrip(": "),  # type: ignore[attr-defined]
                    "identifier": record.id,
                }
            )
        if record.kind == "wandb_run":
            return add(
                {
                    "@id": record.url or _fragment("wandb", record.id),  # type: ignore[attr-defined]
                    "@type": "CreativeWork",
                    "name": f"W&B run {record.run_id} ({record.mode})",  # type: ignore[attr-defined]
                    "identifier": record.id,
                }
            )
        return None

    def linked(record_id: str, relation: str, *, as_subject: bool) -> list[dict[str, str]]:
        out = []
        for rel in closure.relations:
            if rel.relation != relation:
                continue
            if as_subject and rel.subject_id == record_id:
                entity = entity_for(rel.object_id)
            elif not as_subject and rel.object_id == record_id:
                entity = entity_for(rel.subject_id)
            else:
                continue
            if entity is not None and entity not in out:
                out.append(entity)
        return out

    def about(record_id: str) -> list[dict[str, str]]:
        out = []
        for rel in closure.relations:
            for mine, other, kind in (
                (rel.subject_id, rel.object_id, rel.object_kind),
                (rel.object_id, rel.subject_id, rel.subject_kind),
            ):
                if mine == record_id and kind in ("github_issue", "wandb_run"):
                    entity = entity_for(other)
                    if entity is not None and entity not in out:
                        out.append(entity)
        return out

    def timing(record: Any) -> dict[str, Any]:
        return {
            "startTime": iso_time(record.started_at) if record.started_at else None,
            "endTime": iso_time(record.ended_at) if record.ended_at else None,
            "actionStatus": _ref(_STATUS.get(record.state, "http://schema.org/PotentialActionStatus")),
            "error": scrub(record.error, secrets) if getattr(record, "error", None) else None,
        }

    # -- settings and results: each a PropertyValue of its action, an example of a FormalParameter of
    # the workflow (a run's settings: its ``input``) or of a stage's tool (what it measured: ``output``)
    inputs: dict[str, dict[str, str]] = {}
    outputs: dict[str, dict[str, dict[str, str]]] = {}

    def formal(entity_id: str, name: str, value: Any) -> dict[str, str]:
        return add(
            {
                "@id": entity_id,
                "@type": "FormalParameter",
                "name": name,
                "additionalType": _value_type(value),
                "conformsTo": _ref(FORMAL_PARAMETER),
            }
        )

    def values(owner: str, named: Mapping[str, Any], parameter: Any) -> list[dict[str, str]]:
        return [
            add(
                {
                    "@id": _fragment(owner, key),
                    "@type": "PropertyValue",
                    "name": key,
                    "value": _plain(value),
                    "exampleOfWork": parameter(key, value),
                }
            )
            for key, value in sorted(named.items())
            if value is not None
        ]

    def setting(key: str, value: Any) -> dict[str, str]:
        inputs[key] = formal(_fragment("param", key), key, value)
        return inputs[key]

    # -- runs ------------------------------------------------------------------------------------
    mentions = []
    for run in pipelines:
        stage_actions, controls = [], []
        for stage in [s for s in stages if s.pipeline_run_id == run.id]:
            jobs = [
                add(
                    {
                        "@id": f"#job-{a.id}",
                        "@type": "PropertyValue",
                        "name": f"{a.backend} job" + (f" on {a.cluster}" if a.cluster else ""),
                        "value": a.job_id,
                        "description": scrub(
                            f"attempt {a.number}: {a.state}"
                            + (f" exit {a.exit_code}" if a.exit_code is not None else "")
                            + (f" on {a.host}" if a.host else "")
                            + (f", image {a.image_digest}" if a.image_digest else "")
                            + (f" ({a.reason})" if a.reason else ""),
                            secrets,
                        ),
                    }
                )
                for a in sorted(attempts.get(stage.id, []), key=lambda a: a.number)
            ]
            # A reused stage took the outputs of the stage run that made them (another run's): those
            # outputs, and the inputs they were made from, are this action's, so a later stage's
            # input is some action's result and the data snapshot is in the crate.
            source_id = closure.reused.get(stage.id)
            made_by = source_id or stage.id
            maker = closure.records.get(made_by, stage)
            measured = flatten_metrics(clean_value(dict(getattr(maker, "metrics", None) or {}), secrets))

            def result(key: str, value: Any, tool: str = stage.stage) -> dict[str, str]:
                outputs.setdefault(tool, {})[key] = formal(_fragment("output", tool, key), key, value)
                return outputs[tool][key]

            states = [stage.state.lower()]
            if stage.reused_from and stage.state != "REUSED":
                states.append("reused")
            reused = ""
            if source_id:
                source = closure.records.get(source_id)
                owner = getattr(source, "pipeline_run_id", None)
                reused = f"; reuses the outputs of stage run {source_id}" + (f" of run {owner}" if owner else "")
            elif stage.reused_from:
                reused = f"; reuses stage run {stage.reused_from}"
            action = add(
                {
                    "@id": f"#{stage.id}",
                    "@type": "CreateAction",
                    "name": f"{stage.stage} ({', '.join(states)})",
                    "instrument": _ref(f"#tool-{stage.stage}"),
                    "object": linked(made_by, "used", as_subject=True),
                    "result": linked(made_by, "wasGeneratedBy", as_subject=False) + values(stage.id, measured, result),
                    "identifier": [{"@id": f"#identity-{stage.id}"}, *jobs],
                    "subjectOf": about(stage.id),
                    "description": f"stage identity {stage.identity}{reused}",
                    **timing(stage),
                }
            )
            add(
                {
                    "@id": f"#identity-{stage.id}",
                    "@type": "PropertyValue",
                    "name": "stage identity",
                    "value": stage.identity,
                }
            )
            stage_actions.append(action)
            controls.append(
                add(
                    {
                        "@id": f"#control-{stage.id}",
                        "@type": "ControlAction",
                        "name": f"orchestrate {stage.stage}",
                        "instrument": _ref(f"#step-{stage.stage}"),
                        "object": action,
                    }
                )
            )
        # The run consumed its code and whatever its stages used that no stage of it produced.
        produced = [e for a in stage_actions for e in graph[a["@id"]].get("result", [])]
        used = [e for a in stage_actions for e in graph[a["@id"]].get("object", []) if e not in produced]
        run_action = add(
            {
                "@id": f"#{run.id}",
                "@type": "CreateAction",
                "name": f"{name}{f' ({run.replica})' if run.replica else ''} on {run.backend or 'local'}: "
                f"{run.state.lower()}",
                "instrument": workflow,
                "object": _unique(
                    linked(run.id, "wasAssociatedWith", as_subject=True)
                    + used
                    + values(f"{run.id}-setting", run_settings(run, secrets), setting)
                ),
                "result": _unique(produced),
                "subjectOf": about(run.id),
                # Workflow Run RO-Crate's agent: the login account that started the run (a person at
                # the terminal; the account serving the flows for a UI or scheduled run)
                "agent": (
                    add({"@id": f"#{account_id(run.user)}", "@type": "Person", "name": run.user}) if run.user else None
                ),
                "description": f"trigger {run.trigger or 'terminal'}; lineage id {run.id}"
                + (f"; command: {shlex.join(clean_value(run.command, secrets))}" if run.command else ""),
                **timing(run),
            }
        )
        mentions.append(run_action)
        add(
            {
                "@id": f"#organize-{run.id}",
                "@type": "OrganizeAction",
                "name": f"openlab run of {name}",
                "instrument": engine,
                "object": controls,
                "result": run_action,
                "startTime": iso_time(run.started_at),
                "endTime": iso_time(run.ended_at) if run.ended_at else None,
            }
        )

    graph[workflow["@id"]]["input"] = [inputs[key] for key in sorted(inputs)]
    for tool_name, made in outputs.items():
        graph[f"#tool-{tool_name}"]["output"] = [made[key] for key in sorted(made)]
    add({"@id": FORMAL_PARAMETER, "@type": "CreativeWork", "name": "FormalParameter profile", "version": "1.0-RELEASE"})

    root = {
        "@id": "./",
        "@type": "Dataset",
        "name": f"openlab lineage of {name}",
        "description": f"{len(pipelines)} pipeline run(s) of {name} and their stage runs, from openlab lineage",
        "datePublished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "license": _ref("https://spdx.org/licenses/CC-BY-4.0"),
        "conformsTo": [_ref(p) for p in PROFILES] + [_ref(WORKFLOW_PROFILE)],
        "mainEntity": workflow,
        # RO-Crate 1.1: every data entity is reachable from the root by hasPart.
        "hasPart": [workflow, *(_ref(e["@id"]) for e in graph.values() if e.get("@type") in ("File", "Dataset"))],
        "mentions": mentions,
    }
    add({"@id": "https://spdx.org/licenses/CC-BY-4.0", "@type": "CreativeWork", "name": "CC BY 4.0"})
    for profile in [*PROFILES, WORKFLOW_PROFILE]:
        add({"@id": profile, "@type": "CreativeWork", "name": profile.split("/ro/", 1)[-1], "version": profile[-3:]})
    descriptor = {
        "@id": "ro-crate-metadata.json",
        "@type": "CreativeWork",
        "conformsTo": [_ref(RO_CRATE), _ref(WORKFLOW_PROFILE)],
        "about": _ref("./"),
    }
    document = {
        "@context": f"{RO_CRATE}/context",
        "@graph": [descriptor, root, *graph.values()],
    }
    return document, {workflow_path: workflow_text}


def write_rocrate(store: LineageStore, pipeline_run_ids: Sequence[str], directory: Path) -> Path:
    """Write the crate of these runs (or of every run) into ``directory``, which must not exist or
    be empty; the crate appears whole or not at all (built beside it, then renamed)."""
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ExportError(f"{directory} exists and is not an empty directory; name a new directory for the crate")
    document, files = to_rocrate(collect(store, list(pipeline_run_ids)))
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        for relative, text in files.items():
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            (staging / relative).write_text(text, encoding="utf-8")
        (staging / "ro-crate-metadata.json").write_text(
            dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
        if directory.exists():
            directory.rmdir()
        os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory
