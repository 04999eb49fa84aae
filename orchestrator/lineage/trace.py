"""Lineage queries: everything a record came from, or everything that came from it, transitively.

``openlab lineage show`` answers one hop. An audit asks the transitive question:
*which data, commit, issue, W&B run and job produced this checkpoint?* (upstream), or
*which checkpoints were trained on this data snapshot, or at this commit?* (downstream,
e.g. when a snapshot turns out to hold data it must not). Marquez answers it with
``GET /lineage?nodeId&depth``; this is the same walk over our own PROV graph.

Every relation we record points from the later record to the earlier one, as PROV's do
(``wasGeneratedBy`` entity -> activity, ``used`` activity -> entity, ``wasAssociatedWith``
activity -> agent, ``wasInformedBy`` activity -> activity, ``wasDerivedFrom`` entity ->
entity). So *up* follows relations from subject to object and *down* from object to
subject, whatever their name; a W&B run, the one agent people start from, leads up to the
stage run that logged to it ("recordOf"). Two structural links are walked too, because they are
columns rather than relation rows: a stage run's attempts (the jobs that ran it, with
backend, job id and host) and its pipeline run (whose issue and trigger it shares). An attempt
leads, up and down, to the stage run it ran (``jobOf``): a trace from a job, its id or its log
file, is its stage run's, with the job on top. A commit leads down to its dirty trees too
(``wasDerivedFrom``, role ``dirty``: the commit plus uncommitted changes, recorded as
``sha+patch``), so "what was made at this commit" is every run at it.
A record reached twice is shown again but expanded once, so a diamond (two stages that
used one snapshot) cannot loop or repeat a whole subtree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from sqlmodel import Session, col, select

from orchestrator.lineage.models import (
    RECORD_TYPES,
    Attempt,
    Commit,
    LineageRecord,
    PipelineRun,
    Relation,
    StageRun,
    WandbRun,
)
from orchestrator.lineage.store import CommitTrees, LineageStore, in_chunks

Direction = Literal["up", "down"]

#: Relation roles that are bookkeeping of the GitHub mirror (a comment on its issue), not provenance of the work.
SKIPPED_ROLES = frozenset({"comment-on"})

#: The ``patch_hash`` of :func:`whole_commit`'s record, which stands for a commit recorded only
#: with uncommitted changes: no stored record has it (a patch hash is a hex digest, or None).
ALL_TREES = "*"


def whole_commit(sha: str, trees: list[Commit]) -> Commit:
    """A record, not stored, that stands for commit ``sha`` where only its dirty trees were recorded:
    the root of ``lineage trace SHA --down``, its trees below it."""
    first = trees[0] if trees else Commit(id=sha)
    return Commit(
        id=sha,
        sha=sha,
        repo_path=first.repo_path,
        remote_url=first.remote_url,
        branch=first.branch,
        dirty=True,
        patch_hash=ALL_TREES,
        message=first.message,
        authored_at=first.authored_at,
    )


def describe(record: Any) -> str:
    """One line that says what a record is, for lists and trees."""
    kind = record.kind
    if kind == "pipeline_run":
        verdict = (record.verdict or {}).get("status")  # a nightly's: baseline, passed or regressed
        judged = f" nightly {verdict}" if verdict else ""
        where = f"replica={record.replica} backend={record.backend}"
        if record.run_set:  # what this run set over its recipe (`run --set`): what tells it from the runs beside it
            from orchestrator.recipes import set_words

            where += " set " + " ".join(set_words(record.run_set))
        if record.sweep:  # one of a sweep's runs: which sweep, which of its runs
            where += f" sweep {record.sweep.get('id')} {record.sweep.get('run')}/{record.sweep.get('of')}"
        retried = (record.params or {}).get("retry_of")
        where += f" retry of {retried}" if retried else ""  # the run it recovers (UI Retry, `openlab rerun`)
        where += f" user={record.user}" if record.user else ""  # the account that started it, as squeue's USER
        return f"{record.recipe or record.name} {where} {record.state}{judged}"
    if kind == "stage_run":
        reused = f" (reused {record.reused_from})" if record.reused_from else ""
        return f"{record.stage} {record.state} identity={record.identity[:12]}{reused}"
    if kind == "attempt":  # what is known: an attempt refused before it had a job has no job id, exit or host
        where = f"@{record.cluster}" if record.cluster else ""  # the cluster: a job id means something only there
        parts = [f"#{record.number}", f"{record.backend}{where}"]
        parts += [f"job={record.job_id}"] if record.job_id else []
        parts += [str(record.state)]
        parts += [f"exit={record.exit_code}"] if record.exit_code is not None else []
        parts += [f"host={record.host}"] if record.host else []
        why = f": {record.reason}" if record.reason and record.state != "COMPLETED" else ""  # why it did not complete
        return " ".join(parts) + why
    if kind == "snapshot":
        return f"{record.path} files={record.files} bytes={record.bytes}{_removed(record)}"
    if kind == "commit":  # the id is the sha (plus the patch hash when dirty): say what it does not
        where = " ".join(x for x in (record.branch, record.remote_url) if x)
        first_line = (record.message or "").strip().splitlines()[:1]
        state = "dirty" if record.dirty else "clean"
        if record.patch_hash == ALL_TREES:  # whole_commit: no clean tree of it was recorded
            state = "recorded only with uncommitted changes (each tree below)"
        return " ".join(x for x in (state, where, *first_line) if x)
    if kind == "environment":
        image = f" image={record.image_digest[:19]}" if record.image_digest else ""
        gpu = f" gpu={record.gpu}" if record.gpu else ""
        return f"python {record.python} on {record.hostname} ({record.platform}){gpu}{image}"
    if kind == "artifact":
        return f"{record.name} {record.content_hash[:12]} {record.uri}{_removed(record)}"
    if kind == "github_issue":
        return f"{record.title or ''} ({record.state or 'unresolved'})"
    if kind == "wandb_run":
        state = f" {record.state}" if record.state else ""
        return f"{record.mode}{state} {record.url or record.local_dir or ''}".rstrip()
    if kind == "github_comment":
        return f"card comment on {record.issue_id} {record.url or '(not posted yet)'}"
    if kind == "github_digest":
        return f"digest of {record.day} on {record.issue_id} {record.url or '(not posted yet)'}"
    return ""


def _removed(record: Any) -> str:
    """`` (removed 2026-12-05: why)`` for a record whose bytes openlab deleted or replaced, else ``""``."""
    if record.removed_at is None:
        return ""
    return f" (removed {record.removed_at:%Y-%m-%d}: {record.removed_reason or 'no reason recorded'})"


@dataclass
class TraceNode:
    """One record in a trace, with how it was reached from its parent."""

    record: LineageRecord
    relation: str = ""  # how the parent reaches this record ("wasGeneratedBy", "used", "attempt", ...)
    role: str = ""
    repeated: bool = False  # already expanded elsewhere in the tree
    truncated: bool = False  # has further lineage beyond --depth
    children: list[TraceNode] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.record.kind

    @property
    def id(self) -> str:
        return self.record.id  # type: ignore[attr-defined,no-any-return]

    def walk(self) -> Iterator[TraceNode]:
        yield self
        for child in self.children:
            yield from child.walk()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "id": self.id, "summary": describe(self.record)}
        if self.relation:
            out["relation"] = self.relation
        if self.role:
            out["role"] = self.role
        if self.repeated:
            out["repeated"] = True
        if self.truncated:
            out["truncated"] = True
        out["children"] = [c.to_dict() for c in self.children]
        return out


Hop = tuple[str, str, "LineageRecord | tuple[str, str]"]  # (relation, role, record or (kind, id) to load)


def _hops(
    session: Session, records: list[LineageRecord], direction: Direction
) -> dict[str, list[tuple[str, str, LineageRecord]]]:
    """Per record, (relation, role, record) one hop away, relations first in the order they were
    recorded.

    For a whole level of the walk at once: one query for the relations, one per kind for the
    records they name, one for the stage runs' attempts (or a pipeline run's stage runs), each over
    every record of the level. A walk costs a handful of indexed queries a level, not a record.
    """
    ids = [r.id for r in records]  # type: ignore[attr-defined]
    # Only the relations this direction follows, as plain rows (no ORM objects: a level can be
    # thousands): up, those each record is the subject of, and a W&B run's stage runs; down, those
    # each record is the object of.
    wandb_ids = [r.id for r in records if isinstance(r, WandbRun)] if direction == "up" else []
    near = Relation.subject_id if direction == "up" else Relation.object_id
    fields = (Relation.relation, Relation.role, Relation.subject_kind, Relation.subject_id)
    fields += (Relation.object_kind, Relation.object_id)
    rels_of: dict[str, list[Any]] = {rid: [] for rid in ids}
    for chunk in in_chunks(ids):
        here = set(chunk)
        where = col(near).in_(chunk)
        logged = [rid for rid in wandb_ids if rid in here]
        if logged:
            where = where | (col(Relation.object_id).in_(logged) & (Relation.relation == "wasAssociatedWith"))
        query = select(*fields).where(where).order_by(col(Relation.created_at), col(Relation.id))
        for rel in session.exec(query):
            for rid in {rel.subject_id, rel.object_id} & here:  # a relation between two of them: for each
                rels_of[rid].append(rel)
    extra: dict[str, list[Hop]] = {rid: [] for rid in ids}  # the links that are columns, not relations
    stage_ids = [r.id for r in records if isinstance(r, StageRun)]
    if direction == "up" and stage_ids:
        for chunk in in_chunks(stage_ids):
            query = select(Attempt).where(col(Attempt.stage_run_id).in_(chunk)).order_by(col(Attempt.number))
            for attempt in session.exec(query):
                extra[attempt.stage_run_id or ""].append(("ranAs", "job", attempt))
    for record in records:  # a job, either way, leads to the stage run it ran: what it came from, what it made
        if isinstance(record, Attempt) and record.stage_run_id:
            extra[record.id].append(("jobOf", "stage", (StageRun.kind, record.stage_run_id)))
    shas = [r.id for r in records if isinstance(r, Commit) and r.id == r.sha]  # a commit, not one dirty tree of it
    if direction == "down" and shas:
        for chunk in in_chunks(shas):
            query = select(Commit).where(col(Commit.sha).in_(chunk), col(Commit.id) != col(Commit.sha))
            for tree in session.exec(query.order_by(col(Commit.created_at), col(Commit.id))):
                extra[tree.sha or ""].append(("wasDerivedFrom", "dirty", tree))
    run_ids = [r.id for r in records if isinstance(r, PipelineRun)]
    if direction == "down" and run_ids:
        for chunk in in_chunks(run_ids):
            query = select(StageRun).where(col(StageRun.pipeline_run_id).in_(chunk)).order_by(col(StageRun.started_at))
            for srun in session.exec(query):
                extra[srun.pipeline_run_id or ""].append(("hasPart", "stage", srun))

    hops_of: dict[str, list[Hop]] = {}
    for record in records:
        rid = record.id  # type: ignore[attr-defined]
        rels = rels_of[rid]
        hops: list[Hop] = []
        for rel in rels:
            if rel.role in SKIPPED_ROLES:
                continue
            if direction == "up" and rel.subject_id == rid:
                hops.append((rel.relation, rel.role, (rel.object_kind, rel.object_id)))
            elif direction == "down" and rel.object_id == rid:
                hops.append((rel.relation, rel.role, (rel.subject_kind, rel.subject_id)))
        if isinstance(record, WandbRun) and direction == "up":
            # A W&B run is a record *of* the stage job that logged to it: its provenance is that stage's.
            hops += [
                ("recordOf", "", (rel.subject_kind, rel.subject_id))
                for rel in rels
                if rel.object_id == rid and rel.relation == "wasAssociatedWith" and rel.subject_kind == StageRun.kind
            ]
        hops += extra[rid]
        if isinstance(record, StageRun) and direction == "up" and record.pipeline_run_id:
            hops.append(("partOf", "pipeline", (PipelineRun.kind, record.pipeline_run_id)))
        hops_of[rid] = hops

    wanted: dict[str, set[str]] = {}
    for hops in hops_of.values():
        for _, _, target in hops:
            if isinstance(target, tuple) and target[0] in RECORD_TYPES:
                wanted.setdefault(target[0], set()).add(target[1])
    loaded: dict[tuple[str, str], LineageRecord] = {}
    for kind, kind_ids in wanted.items():
        model = RECORD_TYPES[kind]
        for chunk in in_chunks(sorted(kind_ids)):
            for found in session.exec(select(model).where(col(model.id).in_(chunk))):  # type: ignore[attr-defined]
                loaded[(kind, found.id)] = found  # type: ignore[attr-defined]
    out: dict[str, list[tuple[str, str, LineageRecord]]] = {}
    for rid, hops in hops_of.items():
        resolved: list[tuple[str, str, LineageRecord]] = []
        for relation, role, target in hops:
            if isinstance(target, tuple):
                # A relation to a record this store no longer has is left out: `lineage verify` reports it.
                found = loaded.get(target)
                if found is None:
                    continue
                target = found
            resolved.append((relation, role, target))
        out[rid] = resolved
    return out


@dataclass
class Hops:
    """The hops read so far for walks in one direction, kept so several traces share them:
    ``lineage affected`` walks down from every stage run a bad node touched, and reads them all
    in one walk (:meth:`read`) instead of a walk each."""

    direction: Direction
    of: dict[str, list[tuple[str, str, LineageRecord]]] = field(default_factory=dict)

    def read(
        self,
        store: LineageStore,
        roots: list[LineageRecord],
        *,
        prune: Callable[[LineageRecord], bool] | None = None,
    ) -> None:
        """Read the hops of everything below ``roots`` (not below a record ``prune`` says yes to)."""
        with store.session() as session:
            _reach(session, roots, self.direction, None, prune, self.of)


def _reach(
    session: Session,
    roots: list[LineageRecord],
    direction: Direction,
    depth: int | None,
    prune: Callable[[LineageRecord], bool] | None,
    hops_of: dict[str, list[tuple[str, str, LineageRecord]]],
) -> None:
    """Add to ``hops_of`` the hops of every record a tree from ``roots`` will expand: breadth
    first, a level at a time, down to ``depth`` hops (whose hops are read too: they say whether
    the tree goes on), never below a record ``prune`` says yes to. A record the tree expands at
    depth k is at most k hops from its root, so it is there; one already there is not read again."""
    level = {r.id: r for r in roots}  # type: ignore[attr-defined]
    visited = set(level)  # this walk's: a record read by an earlier walk is not read again, but walked
    distance = 0
    while level:
        missing = [r for rid, r in level.items() if rid not in hops_of]
        if missing:
            hops_of |= _hops(session, missing, direction)
        if depth is not None and distance >= depth:
            return
        following: dict[str, LineageRecord] = {}
        for rid in level:
            for _, _, other in hops_of[rid]:
                oid = other.id  # type: ignore[attr-defined]
                if oid not in visited and not (prune is not None and prune(other)):
                    visited.add(oid)
                    following[oid] = other
        level = following
        distance += 1


def trace(
    store: LineageStore,
    record_id: str,
    *,
    direction: Direction = "up",
    depth: int | None = None,
    prune: Callable[[LineageRecord], bool] | None = None,
    hops: Hops | None = None,
) -> TraceNode:
    """The lineage tree of ``record_id`` (whatever :meth:`LineageStore.find` takes: an id, a unique prefix,
    a job id, a sha, a path...) ``depth`` hops deep (None: all of it). A sha recorded only from dirty
    trees is the root of them all (:func:`whole_commit`).

    A record ``prune`` says yes to is a leaf: listed, not expanded, and not counted as expanded,
    so where it is reached again by another way it is expanded there (``lineage affected`` prunes
    stage runs older than the bad job, whose descendants are not the bad job's).

    The records are read level by level first (:func:`_reach`), then the tree is built depth
    first from what was read, each record expanded where the walk first meets it. ``hops`` (read
    the same ``direction``) holds what earlier walks read, so this one reads only what they did not.
    """
    try:
        found = store.find(record_id)
    except CommitTrees as trees:  # a sha of dirty trees only: the commit stands above them all
        found = whole_commit(trees.sha, trees.trees)
    root = TraceNode(found)
    if hops is not None and hops.direction != direction:
        raise ValueError(f"hops read {hops.direction} cannot serve a walk {direction}")
    hops_of = hops.of if hops is not None else {}
    expanded: set[str] = set()

    def grow(node: TraceNode, left: int | None, parent: str | None) -> None:
        if node.id in expanded:
            node.repeated = True
            return
        expanded.add(node.id)
        # A job reached from its stage run does not lead back to it: a line under every job of a trace.
        below = [h for h in hops_of[node.id] if not (h[0] == "jobOf" and h[2].id == parent)]  # type: ignore[attr-defined]
        if left == 0:
            node.truncated = bool(below)
            return
        for relation, role, other in below:
            child = TraceNode(other, relation, role)
            node.children.append(child)
            if prune is None or not prune(other):
                grow(child, None if left is None else left - 1, node.id)

    with store.session() as session:  # one session for the whole walk, not one per record
        _reach(session, [root.record], direction, depth, prune, hops_of)
        grow(root, depth, None)
    return root


#: PROV's drawing conventions: entities yellow ellipses, activities blue boxes, agents orange houses.
_ENTITY = 'shape=ellipse, style=filled, fillcolor="#fffc87"'
_ACTIVITY = 'shape=box, style=filled, fillcolor="#9fb1fc"'
_AGENT = 'shape=house, style=filled, fillcolor="#fed37f"'
#: Shapes by PROV class, as PROV's own diagrams draw them; the class is the record's (``prov_type``), the
#: one ``lineage export -f prov`` writes, so a picture and an export never disagree on what a record is.
_DOT_STYLE = {"entity": _ENTITY, "activity": _ACTIVITY, "agent": _AGENT}
#: Kinds drawn apart from their class: an issue is an entity, drawn as the note it is.
_DOT_KIND_STYLE = {"github_issue": 'shape=note, style=filled, fillcolor="#e8e8e8"'}


def _dot_style(record: Any) -> str:
    kind = getattr(record, "kind", "")
    return _DOT_KIND_STYLE.get(kind) or _DOT_STYLE.get(getattr(record, "prov_type", ""), "shape=box")


_PART_OF = frozenset({"hasPart", "jobOf"})


def to_dot(root: TraceNode, direction: Direction) -> str:
    """The trace as a Graphviz digraph (``openlab lineage trace ID --dot | dot -Tsvg``): each record
    once, however often the walk met it, so a diamond is drawn as one; arrows as PROV draws them,
    from the later record to the earlier one it names (a checkpoint to the stage that generated it,
    a stage to the data it used), with the relation as the label, and the data at the top."""
    nodes: dict[str, str] = {}
    edges: dict[tuple[str, str, str], None] = {}  # in the order met, each once
    pairs: set[tuple[str, str]] = set()

    def visit(node: TraceNode) -> None:
        if node.id not in nodes:
            summary = describe(node.record)
            short = summary if len(summary) <= 48 else summary[:47] + "…"
            shown = node.id if len(node.id) <= 32 else node.id[:16]  # a sha or a content hash: its head
            label = f"{node.kind}\\n{_dot_escape(shown)}\\n{_dot_escape(short)}"  # \\n: DOT's line break
            style = _dot_style(node.record)
            if node.truncated:  # its lineage goes on beyond --depth: a dashed border says the picture stops here
                style = style.replace("style=filled", 'style="filled,dashed"')
                summary += " (more beyond --depth)"
            nodes[node.id] = f'  "{_dot_escape(node.id)}" [label="{label}", tooltip="{_dot_escape(summary)}", {style}];'
        for child in node.children:
            # down, the child is the later record, but for a run's stage (hasPart) or a job's stage run (jobOf)
            later, earlier = (child, node) if direction == "down" and child.relation not in _PART_OF else (node, child)
            role = f" ({child.role})" if child.role else ""
            if (earlier.id, later.id) not in pairs:  # a W&B run's recordOf its stage: one arrow is enough
                pairs.add((later.id, earlier.id))
                edges[(later.id, earlier.id, f"{child.relation}{role}")] = None
            visit(child)

    visit(root)
    lines = ["digraph lineage {", "  rankdir=BT;", '  node [fontname="Helvetica", fontsize=10];']
    lines += ['  edge [fontname="Helvetica", fontsize=9];', *nodes.values()]
    lines += [f'  "{_dot_escape(a)}" -> "{_dot_escape(b)}" [label="{_dot_escape(label)}"];' for a, b, label in edges]
    return "\n".join([*lines, "}"]) + "\n"


def _dot_escape(text: str) -> str:
    """Text for inside a DOT double-quoted string: backslashes and quotes escaped, one line."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


__all__ = ["ALL_TREES", "Direction", "Hops", "TraceNode", "describe", "to_dot", "trace", "whole_commit"]
