"""Export lineage in the open formats other tools read: W3C PROV-JSON and OpenLineage (here), and
Workflow Run RO-Crate (:mod:`orchestrator.lineage.rocrate`, built on this module's closure).

Why both: PROV is the archival answer to "what produced this, from what, by whom" and maps
one to one onto the store (every record is an entity, activity or agent; every
:class:`~orchestrator.lineage.models.Relation` is the PROV relation of the same name).
OpenLineage is what lineage servers such as Marquez ingest: one ``RunEvent`` per run
transition, with the job's inputs and outputs as datasets.

What is exported is a *closure*: the pipeline runs asked for, their stage runs and
attempts, and every record one relation away from those (commits, environments, data
snapshots, artifacts, issues, W&B runs). With no pipeline run named, the whole store.

Secrets never leave: secret-named keys (``*TOKEN*``, ``*KEY*`` ...) anywhere in a record are
masked and any secret value of this process's environment is scrubbed from every string
(:mod:`orchestrator.secrets`) — an export is something people publish.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from sqlmodel import col

from orchestrator.errors import OpenlabError, choices
from orchestrator.lineage.models import (
    RECORD_TYPES,
    Attempt,
    LineageRecord,
    PipelineRun,
    Relation,
    StageRun,
    strict_json,
)
from orchestrator.lineage.store import LineageStore, record_payload
from orchestrator.secrets import redact_value, scrub, secret_values

#: Formats :func:`export` writes as text. An RO-Crate is a directory, written by
#: :func:`orchestrator.lineage.rocrate.write_rocrate`.
FORMATS = ("prov", "openlineage")

#: The PROV namespace every openlab id lives in. A URN, so it resolves nowhere and claims no domain.
OPENLAB_NS = "urn:openlab:"
#: Run ids in OpenLineage must be UUIDs; ours are derived from the lineage id so re-exports agree.
RUN_ID_NAMESPACE = uuid.UUID("0b8f8f4e-6c1e-5a7b-9d64-0a5c3c1f9e21")

OL_SPEC = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent"
OL_FACETS = "https://openlineage.io/spec/facets"
VERSION_FACET = f"{OL_FACETS}/1-0-1/DatasetVersionDatasetFacet.json#/$defs/DatasetVersionDatasetFacet"
OPENLAB_FACET_SCHEMA = "urn:openlab:facets:OpenlabRunFacet:1"


class ExportError(OpenlabError):
    """An export could not be made (unknown run id, unknown format)."""


def producer_uri() -> str:
    try:
        return f"urn:openlab:{version('openlab')}"
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "urn:openlab:dev"


# -- the closure ----------------------------------------------------------------------


@dataclass
class Closure:
    """The records and relations one export covers, keyed by lineage id."""

    records: dict[str, LineageRecord] = field(default_factory=dict)
    relations: list[Relation] = field(default_factory=list)
    #: A reused stage run's id -> the id of the stage run that made the outputs it took.
    reused: dict[str, str] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[Any]:
        return [r for r in self.records.values() if r.kind == kind]


def collect(store: LineageStore, pipeline_run_ids: Sequence[str] = ()) -> Closure:
    """The records an export of these pipeline runs (or of everything) covers."""
    closure = Closure()
    if not pipeline_run_ids:
        for kind, model in RECORD_TYPES.items():
            if kind != "relation":
                for record in store.list(model):
                    closure.records[record.id] = record  # type: ignore[attr-defined]
        closure.relations = store.list(Relation, order_by=col(Relation.created_at))
        for record in list(closure.records.values()):  # every stage run is here: no query a reuse
            source = reused_source(closure.records.get, record)
            if source is not None:
                closure.reused[record.id] = source.id  # type: ignore[attr-defined]
        return closure

    core: list[LineageRecord] = []
    for run_id in pipeline_run_ids:
        run = store.find(run_id)
        if not isinstance(run, PipelineRun):
            raise ExportError(f"{run_id!r} is a {run.kind}, not a pipeline run; `openlab lineage list` shows run ids")
        core.append(run)
        stages = store.list(StageRun, pipeline_run_id=run.id)
        core.extend(stages)
        for stage in stages:
            core.extend(store.list(Attempt, stage_run_id=stage.id))
    for record in core:
        closure.records[record.id] = record  # type: ignore[attr-defined]
    seen: set[str] = set()
    # A reused stage run records one edge, to the stage run that made its outputs: that one's inputs
    # and outputs are what the reuse took, so they are exported too (where a reused stage's input came
    # from, and the outputs a later stage of these runs used).
    core_ids = {record.id for record in core}  # type: ignore[attr-defined]
    sources: list[StageRun] = []
    for record in core:
        source = reused_source(store, record)
        if source is not None:
            closure.reused[record.id] = source.id  # type: ignore[attr-defined]
            if source.id not in core_ids:
                sources.append(source)
    for record in [*core, *sources]:
        is_source = record.id not in core_ids  # type: ignore[attr-defined]
        for rel in store.relations(record.id):  # type: ignore[attr-defined]
            if rel.id in seen:
                continue
            if is_source and not (
                (rel.relation == "used" and rel.subject_id == record.id)  # type: ignore[attr-defined]
                or (rel.relation == "wasGeneratedBy" and rel.object_id == record.id)  # type: ignore[attr-defined]
            ):
                continue
            seen.add(rel.id)
            closure.relations.append(rel)
            for kind, rid in ((rel.subject_kind, rel.subject_id), (rel.object_kind, rel.object_id)):
                if rid not in closure.records and kind in RECORD_TYPES:
                    other = store.get(RECORD_TYPES[kind], rid)
                    if other is not None:
                        closure.records[rid] = other
    for run in [r for r in closure.records.values() if isinstance(r, PipelineRun)]:
        if run.experiment_id and run.experiment_id not in closure.records:
            experiment = store.get(RECORD_TYPES["experiment"], run.experiment_id)
            if experiment is not None:
                closure.records[experiment.id] = experiment  # type: ignore[attr-defined]
    return closure


def reused_source(get: Callable[[str], Any] | LineageStore, record: Any) -> StageRun | None:
    """The stage run whose outputs a reused stage run took (followed through a reuse of a reuse),
    or None for one that is no reuse or whose source is gone. ``get`` finds a stage run by id: a
    store, or a lookup of records already read."""
    if not isinstance(record, StageRun) or not record.reused_from:
        return None
    find = (lambda rid: get.get(StageRun, rid)) if isinstance(get, LineageStore) else get
    source, seen = record, {record.id}
    while source.reused_from and source.reused_from not in seen:
        seen.add(source.reused_from)
        found = find(source.reused_from)
        if not isinstance(found, StageRun):
            break
        source = found
    return source if source is not record else None


def patch_files(closure: Closure) -> dict[str, Path]:
    """Where each dirty-tree commit's patch (its uncommitted changes, ``git apply --binary`` on the
    commit) is in this openlab home's blob store, by commit id; only those present here. An export
    names the file, as it names outputs by their paths, and does not copy it: a working tree's
    diff may hold what no export should carry."""
    dirty = [r for r in closure.records.values() if r.kind == "commit" and getattr(r, "patch_hash", None)]
    if not dirty:
        return {}
    from orchestrator.settings import load_settings

    blobs = load_settings().blobs_dir
    found = {c.id: blobs / c.patch_hash for c in dirty}  # type: ignore[attr-defined]
    return {commit_id: path for commit_id, path in found.items() if path.is_file()}


# -- secret-safe values -----------------------------------------------------------------


def clean_value(value: Any, secrets: Sequence[str]) -> Any:
    """``value`` with credentials masked and secret values scrubbed, recursively.

    The same rule as the store's write gate (:func:`orchestrator.secrets.redact_value`),
    applied again because a database written by an older openlab, or edited by hand,
    may hold what today's gate would have masked.
    """
    if isinstance(value, dt.datetime):
        return iso_time(value)
    if isinstance(value, tuple):
        value = list(value)
    return redact_value(value, secrets)


def dumps(value: Any, **options: Any) -> str:
    """Strict JSON of an export (see :func:`strict_json`)."""
    return json.dumps(strict_json(value), allow_nan=False, default=str, **options)


def iso_time(when: dt.datetime) -> str:
    if when.tzinfo is None:  # stored naive on an old row: the store only ever writes UTC
        when = when.replace(tzinfo=dt.UTC)
    return when.isoformat()


def _payload(record: LineageRecord, secrets: Sequence[str]) -> dict[str, Any]:
    return clean_value(record_payload(record), secrets)


# -- W3C PROV-JSON -----------------------------------------------------------------------

#: Our relation name -> (PROV-JSON section, subject attribute, object attribute).
PROV_RELATIONS: dict[str, tuple[str, str, str]] = {
    "used": ("used", "prov:activity", "prov:entity"),
    "wasGeneratedBy": ("wasGeneratedBy", "prov:entity", "prov:activity"),
    "wasDerivedFrom": ("wasDerivedFrom", "prov:generatedEntity", "prov:usedEntity"),
    "wasInformedBy": ("wasInformedBy", "prov:informed", "prov:informant"),
    "wasStartedBy": ("wasStartedBy", "prov:activity", "prov:trigger"),
}
#: The software agent every activity is associated with when its plan is a commit or environment.
ORCHESTRATOR_AGENT = "openlab:orchestrator"


def _qn(record_id: str) -> str:
    return f"openlab:{record_id}"


def to_prov(closure: Closure) -> dict[str, Any]:
    """The closure as a PROV-JSON document (https://www.w3.org/submissions/prov-json/)."""
    secrets = secret_values()
    doc: dict[str, Any] = {"prefix": {"openlab": OPENLAB_NS}}

    def section(name: str) -> dict[str, Any]:
        return doc.setdefault(name, {})

    section("agent")[ORCHESTRATOR_AGENT] = {"prov:type": {"$": "prov:SoftwareAgent", "type": "prov:QUALIFIED_NAME"}}
    patches = patch_files(closure)
    for record in closure.records.values():
        attrs: dict[str, Any] = {"prov:type": {"$": f"openlab:{record.kind}", "type": "prov:QUALIFIED_NAME"}}
        for key, value in _payload(record, secrets).items():
            if key == "id" or value is None:
                continue
            if record.prov_type == "activity" and key in ("started_at", "submitted_at", "ended_at"):
                continue
            # PROV attribute values are literals: structured fields travel as JSON text.
            attrs[f"openlab:{key}"] = json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else value
        if record.id in patches:  # type: ignore[attr-defined]
            # a dirty tree's commit: where its uncommitted changes are (a file URI, as outputs are named)
            attrs["openlab:patch_location"] = scrub(patches[record.id].resolve().as_uri(), secrets)  # type: ignore[attr-defined]
        if record.prov_type == "activity":
            start = getattr(record, "started_at", None) or getattr(record, "submitted_at", None)
            end = getattr(record, "ended_at", None)
            if start is not None:
                attrs["prov:startTime"] = iso_time(start)
            if end is not None:
                attrs["prov:endTime"] = iso_time(end)
        section(record.prov_type)[_qn(record.id)] = attrs  # type: ignore[attr-defined]

    for rel in closure.relations:
        subject, obj = _qn(rel.subject_id), _qn(rel.object_id)
        extra = {"prov:role": rel.role} if rel.role else {}
        if rel.relation == "wasAssociatedWith":
            target = closure.records.get(rel.object_id)
            if target is not None and target.prov_type == "agent":
                body = {"prov:activity": subject, "prov:agent": obj, **extra}
            else:  # a commit or environment is the plan the orchestrator followed, not an agent
                body = {"prov:activity": subject, "prov:agent": ORCHESTRATOR_AGENT, "prov:plan": obj, **extra}
            section("wasAssociatedWith")[_qn(rel.id)] = body
            continue
        kind, subject_attr, object_attr = PROV_RELATIONS[rel.relation]
        body = {subject_attr: subject, object_attr: obj}
        if rel.role:
            # PROV allows prov:role on usage, generation, start and association, not on communication:
            # there the role (`reused`, `retry-of`: what tells a reuse from a retry) is openlab's attribute
            body["openlab:role" if kind == "wasInformedBy" else "prov:role"] = rel.role
        section(kind)[_qn(rel.id)] = body

    # Structure the store keeps in foreign keys, said in PROV: a pipeline run started its
    # stage runs, a stage run started its attempts, an experiment is the agent of its runs.
    for record in closure.records.values():
        parent = getattr(record, "pipeline_run_id", None) or getattr(record, "stage_run_id", None)
        if parent and parent in closure.records:
            section("wasStartedBy")[f"openlab:started-{record.id}"] = {  # type: ignore[attr-defined]
                "prov:activity": _qn(record.id),  # type: ignore[attr-defined]
                "prov:starter": _qn(parent),
            }
        experiment = getattr(record, "experiment_id", None)
        if experiment and experiment in closure.records:
            section("wasAssociatedWith")[f"openlab:by-{record.id}"] = {  # type: ignore[attr-defined]
                "prov:activity": _qn(record.id),  # type: ignore[attr-defined]
                "prov:agent": _qn(experiment),
            }
        # The login account that started a run or submitted a job: PROV's "by whom".
        user = getattr(record, "user", None)
        if user:
            agent = _qn(account_id(user))
            section("agent")[agent] = {
                "prov:type": {"$": "openlab:account", "type": "prov:QUALIFIED_NAME"},
                "prov:label": user,
            }
            section("wasAssociatedWith")[f"openlab:user-of-{record.id}"] = {  # type: ignore[attr-defined]
                "prov:activity": _qn(record.id),  # type: ignore[attr-defined]
                "prov:agent": agent,
                "prov:role": "started-by" if isinstance(record, PipelineRun) else "submitted-by",
            }
    return doc


def account_id(user: str) -> str:
    """The exported id of a login account, ``account-alice`` (``openlab:account-alice`` in PROV,
    ``#account-alice`` in an RO-Crate): anything but letters, digits, ``.``, ``_`` and ``-``
    percent-encoded, so any name makes a valid qualified name."""
    return f"account-{urllib.parse.quote(user, safe='._-')}"


# -- OpenLineage ---------------------------------------------------------------------------


_SCP_LIKE = re.compile(r"^(?P<user>[\w.-]+@)?(?P<host>[\w.-]+):(?!//)(?P<path>.+)$")


def _repo_uri(location: str | None) -> str | None:
    """A repository location as a URI (the facet's ``url`` must be one).

    ``https://``/``ssh://`` remotes stay as they are, scp-like ``git@host:org/repo.git``
    becomes ``ssh://git@host/org/repo.git`` and a local path a ``file://`` URI.
    """
    if not location:
        return None
    if "://" in location:
        return location
    scp = _SCP_LIKE.match(location)
    if scp and not location.startswith("/"):
        return f"ssh://{scp['user'] or ''}{scp['host']}/{scp['path'].lstrip('/')}"
    return Path(location).resolve().as_uri()


def run_uuid(record_id: str) -> str:
    """The OpenLineage runId of a pipeline or stage run: a UUID derived from its lineage id."""
    return str(uuid.uuid5(RUN_ID_NAMESPACE, record_id))


def _facet(producer: str, schema: str, **fields: Any) -> dict[str, Any]:
    return {"_producer": producer, "_schemaURL": schema, **{k: v for k, v in fields.items() if v is not None}}


_TERMINAL = {
    "COMPLETED": "COMPLETE",
    "REUSED": "COMPLETE",
    "FAILED": "FAIL",
    "LOST": "FAIL",
    "CANCELLED": "ABORT",
    "PREEMPTED": "ABORT",  # stopped from outside, not failed
}


def _job_name(pipeline: PipelineRun | None, stage: StageRun | None = None) -> str:
    base = (pipeline.recipe or pipeline.name or "pipeline") if pipeline else "pipeline"
    if pipeline is not None and pipeline.replica:
        base = f"{base}.{pipeline.replica}"
    return f"{base}.{stage.stage}" if stage is not None else base


def to_openlineage(closure: Closure, namespace: str = "openlab") -> list[dict[str, Any]]:
    """OpenLineage RunEvents (spec 2-0-2): a START and, once ended, a terminal event per run.

    Pipeline runs are parent jobs; each stage run is a child job carrying the ``parent``
    facet, and a pipeline run of a sweep carries one naming the sweep (job
    ``<recipe>.<replica>.sweep``, run id derived from the sweep's id as a record's is). Inputs
    are the stage's ``used`` records, outputs its ``wasGeneratedBy`` ones, each a dataset whose
    version facet is its content hash. Lineage ids the formats have
    no field for (commit, issue, W&B run, backend job ids) ride in an ``openlab`` facet.
    """
    secrets = secret_values()
    producer = producer_uri()
    by_subject: dict[str, list[Relation]] = {}
    by_object: dict[str, list[Relation]] = {}
    for rel in closure.relations:
        by_subject.setdefault(rel.subject_id, []).append(rel)
        by_object.setdefault(rel.object_id, []).append(rel)

    def dataset(record: Any) -> dict[str, Any]:
        if record.kind == "snapshot":
            name, ver = record.path, record.id
        elif record.kind == "artifact":
            name, ver = record.uri, record.content_hash
        else:
            name, ver = record.id, record.id
        return {
            "namespace": "file" if record.kind in ("snapshot", "artifact") else namespace,
            "name": scrub(str(name), secrets),
            "facets": {"version": _facet(producer, VERSION_FACET, datasetVersion=ver)},
        }

    def linked_ids(run_id: str) -> dict[str, list[str]]:
        ids: dict[str, list[str]] = {}
        for rel in by_subject.get(run_id, []) + by_object.get(run_id, []):
            other = rel.object_id if rel.subject_id == run_id else rel.subject_id
            other_kind = rel.object_kind if rel.subject_id == run_id else rel.subject_kind
            if other_kind in ("commit", "environment", "github_issue", "wandb_run"):
                ids.setdefault(other_kind, []).append(other)
        return ids

    def code_facet(run_id: str) -> dict[str, Any] | None:
        for rel in by_subject.get(run_id, []):
            commit = closure.records.get(rel.object_id)
            if rel.relation == "wasAssociatedWith" and commit is not None and commit.kind == "commit":
                where = commit.remote_url or commit.repo_path  # type: ignore[attr-defined]
                url = _repo_uri(where)
                if url:
                    return _facet(
                        producer,
                        f"{OL_FACETS}/1-0-1/SourceCodeLocationJobFacet.json#/$defs/SourceCodeLocationJobFacet",
                        type="git",
                        url=scrub(url, secrets),
                        repoUrl=scrub(where if "@" in where and "://" not in where else url, secrets),
                        version=commit.sha,  # type: ignore[attr-defined]
                        branch=commit.branch,  # type: ignore[attr-defined]
                    )
        return None

    def openlab_facet(record: Any) -> dict[str, Any]:
        fields: dict[str, Any] = {"lineageId": record.id, "kind": record.kind, "state": record.state}
        fields["links"] = linked_ids(record.id)
        if isinstance(record, StageRun):
            attempts = sorted(
                (r for r in closure.records.values() if isinstance(r, Attempt) and r.stage_run_id == record.id),
                key=lambda a: a.number,
            )
            keep = (
                "id",
                "number",
                "backend",
                "cluster",
                "job_id",
                "user",
                "host",
                "image_digest",
                "state",
                "exit_code",
            )
            fields |= {
                "identity": record.identity,
                "reusedFrom": record.reused_from,
                "metrics": clean_value(record.metrics, secrets),
                "attempts": [clean_value({k: getattr(a, k) for k in keep}, secrets) for a in attempts],
            }
        else:
            fields |= {
                "params": clean_value(record.params, secrets),
                "verdict": clean_value(record.verdict, secrets),
                "trigger": record.trigger,
                "user": record.user,
                "command": clean_value(record.command, secrets),
            }
        return _facet(producer, OPENLAB_FACET_SCHEMA, **fields)

    def events_for(record: Any, job_name: str, job_type: str, parent: PipelineRun | None) -> Iterator[dict[str, Any]]:
        run_facets: dict[str, Any] = {
            "processing_engine": _facet(
                producer,
                f"{OL_FACETS}/1-1-1/ProcessingEngineRunFacet.json#/$defs/ProcessingEngineRunFacet",
                name="openlab",
                version=producer.rsplit(":", 1)[-1],
                openlineageAdapterVersion=producer.rsplit(":", 1)[-1],
            ),
            "openlab": openlab_facet(record),
        }
        if parent is not None:
            run_facets["parent"] = _facet(
                producer,
                f"{OL_FACETS}/1-0-1/ParentRunFacet.json#/$defs/ParentRunFacet",
                run={"runId": run_uuid(parent.id)},
                job={"namespace": namespace, "name": _job_name(parent)},
            )
        elif isinstance(record, PipelineRun) and record.sweep.get("id"):
            # one run of a sweep: the sweep is its parent run, so a lineage server groups the sweep's runs
            run_facets["parent"] = _facet(
                producer,
                f"{OL_FACETS}/1-0-1/ParentRunFacet.json#/$defs/ParentRunFacet",
                run={"runId": run_uuid(record.sweep["id"])},
                job={"namespace": namespace, "name": f"{_job_name(record)}.sweep"},
            )
        job_facets: dict[str, Any] = {
            "jobType": _facet(
                producer,
                f"{OL_FACETS}/2-0-3/JobTypeJobFacet.json#/$defs/JobTypeJobFacet",
                processingType="BATCH",
                integration="OPENLAB",
                jobType=job_type,
            )
        }
        code = code_facet(record.id)
        if code is not None:
            job_facets["sourceCodeLocation"] = code
        inputs = [
            dataset(closure.records[r.object_id])
            for r in by_subject.get(record.id, [])
            if r.relation == "used" and r.object_id in closure.records
        ]
        outputs = [
            dataset(closure.records[r.subject_id])
            for r in by_object.get(record.id, [])
            if r.relation == "wasGeneratedBy" and r.subject_id in closure.records
        ]
        base = {
            "producer": producer,
            "schemaURL": OL_SPEC,
            "job": {"namespace": namespace, "name": job_name, "facets": job_facets},
            "inputs": inputs,
        }
        yield {
            **base,
            "eventType": "START",
            "eventTime": iso_time(record.started_at),
            "run": {"runId": run_uuid(record.id), "facets": run_facets},
            "outputs": [],
        }
        terminal = _TERMINAL.get(record.state)
        if terminal is not None and record.ended_at is not None:
            facets = dict(run_facets)
            if record.error:
                facets["errorMessage"] = _facet(
                    producer,
                    f"{OL_FACETS}/1-0-1/ErrorMessageRunFacet.json#/$defs/ErrorMessageRunFacet",
                    message=scrub(record.error, secrets),
                    programmingLanguage="python",
                )
            yield {
                **base,
                "eventType": terminal,
                "eventTime": iso_time(record.ended_at),
                "run": {"runId": run_uuid(record.id), "facets": facets},
                "outputs": outputs,
            }

    events: list[dict[str, Any]] = []
    pipelines = {r.id: r for r in closure.records.values() if isinstance(r, PipelineRun)}
    for pipeline in sorted(pipelines.values(), key=lambda r: r.started_at):
        events.extend(events_for(pipeline, _job_name(pipeline), "PIPELINE", None))
    # A stage run of another pipeline run is in the closure only as a neighbour (the run
    # that reused it, say): it belongs to its own pipeline's events, not this export's.
    stages = [
        r
        for r in closure.records.values()
        if isinstance(r, StageRun) and (r.pipeline_run_id is None or r.pipeline_run_id in pipelines)
    ]
    for stage in sorted(stages, key=lambda r: r.started_at):
        parent = pipelines.get(stage.pipeline_run_id or "")
        events.extend(events_for(stage, _job_name(parent, stage), "STAGE", parent))
    events.sort(key=lambda e: e["eventTime"])
    return events


def export(store: LineageStore, fmt: str, pipeline_run_ids: Iterable[str] = (), namespace: str = "openlab") -> str:
    """The export as text: one PROV-JSON document, or OpenLineage events as JSON lines."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; {choices(fmt, FORMATS, label='formats')}")
    closure = collect(store, list(pipeline_run_ids))
    if fmt == "prov":
        return dumps(to_prov(closure), indent=2, sort_keys=True) + "\n"
    return "".join(dumps(e, sort_keys=True) + "\n" for e in to_openlineage(closure, namespace))
