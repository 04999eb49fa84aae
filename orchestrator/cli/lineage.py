"""``openlab lineage``: list, show, diff and verify what was recorded."""

from __future__ import annotations

import json
import logging
import math
import re
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.padding import Padding
from rich.text import Text

from orchestrator.cli.output import (
    compact_table,
    console,
    describe_task,
    describe_usage,
    fit_last_column,
    given_path,
    narrow,
    print_fields,
    print_json,
    say,
)
from orchestrator.errors import ConfigError, NotFoundError, choices

if TYPE_CHECKING:
    from orchestrator.lineage.diff import Section

app = typer.Typer(help="Audit lineage: which commit, data, environment and job produced what.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]

# The filters `list` and `export` share (orchestrator.lineage.listing.RecordFilter).
StateOpt = Annotated[
    list[str] | None,
    typer.Option("--state", "-s", help="Only runs, stage runs and attempts in this state (FAILED, RUNNING...)."),
]
RecipeOpt = Annotated[str | None, typer.Option("--recipe", help="Only runs of this recipe (and their stages).")]
ReplicaOpt = Annotated[str | None, typer.Option("--replica", help="Only runs of this replica.")]
BackendOpt = Annotated[str | None, typer.Option("--backend", help="Only runs and jobs on this backend.")]
SinceOpt = Annotated[
    str | None, typer.Option("--since", help="Only records from then on: 2026-12-01, 2026-12-01T14:00, 12h, 7d.")
]
UntilOpt = Annotated[str | None, typer.Option("--until", help="Only records before this time (same forms).")]
CommitOpt = Annotated[str | None, typer.Option("--commit", help="Only runs made at this commit (a sha prefix).")]
IssueOpt = Annotated[
    str | None, typer.Option("--issue", help="Only runs linked to this experiment issue (owner/repo#N or #N).")
]
HostOpt = Annotated[
    str | None,
    typer.Option("--host", help="Only jobs that ran on this machine (any task or node), and their runs."),
]
ClusterOpt = Annotated[
    str | None, typer.Option("--cluster", help="Only jobs that ran on this cluster (see job status), and their runs.")
]
UserOpt = Annotated[
    str | None,
    typer.Option("--user", "-u", help="Only runs this login account started and jobs it submitted (squeue -u)."),
]
TriggerOpt = Annotated[
    str | None,
    typer.Option("--trigger", help="Only runs started so (terminal, ui, schedule, automation, adopt), their jobs."),
]

#: What `lineage list` shows by default: the activities people audit, newest first.
DEFAULT_KINDS = ("pipeline_run", "stage_run", "attempt", "snapshot")


OverOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--over",
        help="Take the comparison over this value (seed): a row per group of runs asked the same but for it, "
        "each metric as mean ± standard deviation over the group. Repeatable.",
    ),
]
SweepOpt = Annotated[
    str | None,
    typer.Option("--sweep", help="Only the runs of this sweep (swp_…, as `openlab sweep` prints it), their jobs."),
]


def _record_filter(options: dict[str, Any]) -> Any:
    """The RecordFilter of a command's filter options (its ``locals()``: each command takes the
    filters it can answer, under their RecordFilter names; the others are unset)."""
    from dataclasses import fields

    from orchestrator.lineage.listing import RecordFilter

    return RecordFilter.from_options(**{f.name: options.get(f.name) for f in fields(RecordFilter)})


def _open() -> Any:
    """The store to audit: an existing one only (a mistyped path must not read as an empty history)."""
    from orchestrator.lineage.store import open_store

    return open_store(create=False)


@app.command("list")
def list_cmd(
    kind: Annotated[
        list[str] | None,
        typer.Option("--kind", "-k", help="Record kind(s) to list (default: runs, stage runs, attempts, snapshots)."),
    ] = None,
    state: StateOpt = None,
    stage: Annotated[
        list[str] | None, typer.Option("--stage", help="Only stage runs (and their attempts) of this stage.")
    ] = None,
    recipe: RecipeOpt = None,
    replica: ReplicaOpt = None,
    backend: BackendOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    commit: CommitOpt = None,
    issue: IssueOpt = None,
    host: HostOpt = None,
    cluster: ClusterOpt = None,
    user: UserOpt = None,
    trigger: TriggerOpt = None,
    sweep: SweepOpt = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="At most this many records.")] = 50,
    json_out: JsonFlag = False,
) -> None:
    """List recorded runs, stage runs, attempts and snapshots, newest first, optionally filtered.

    `openlab lineage list --stage pretrain --state FAILED --since 7d` answers "which pretrain jobs
    failed this week"; a filter reaches through a record's run (an attempt's stage, a stage run's
    recipe), and one no listed kind can answer is an error, never an empty list.
    """
    from orchestrator.lineage.listing import list_records, time_field
    from orchestrator.lineage.store import record_payload
    from orchestrator.lineage.trace import describe

    flt = _record_filter(locals())
    store = _open()
    listing = list_records(store, kind or list(DEFAULT_KINDS), flt, limit=limit, strict=bool(kind))
    rows = listing.records
    if json_out:
        print_json([{"kind": r.kind, **record_payload(r)} for r in rows])
        return
    if not rows:
        console.print("no records match", markup=False)
        return
    if narrow():  # a table squeezed the summaries to a few words a line: a block per record instead
        console.print(f"lineage ({store.url.split('://')[0]})", style="italic", highlight=False)
        for r in rows:
            field = time_field(type(r))
            when = getattr(r, field) if field else None
            say(f"{r.kind} {r.id}  {when:%Y-%m-%d %H:%M:%S}" if when else f"{r.kind} {r.id}")
            console.print(Padding(Text(describe(r)), (0, 0, 0, 4)))  # wrapped by word, under its record
        if listing.matched > len(rows):
            say(f"{len(rows)} of {listing.matched} matching records shown; --limit shows more")
        return
    # ids are what a reader copies into `lineage show`: whole, on one line; the summary wraps instead
    table = compact_table(f"lineage ({store.url.split('://')[0]})")
    table.add_column("kind", no_wrap=True)
    # run, stage run and attempt ids (up to 25 characters) whole; a 40-digit commit sha may fold
    table.add_column("id", overflow="fold", min_width=min(26, max(len(r.id) for r in rows)))
    table.add_column("when", no_wrap=True, min_width=19)
    table.add_column("summary", overflow="fold")
    for r in rows:
        field = time_field(type(r))
        when = getattr(r, field) if field else None
        table.add_row(r.kind, r.id, when.strftime("%Y-%m-%d %H:%M:%S") if when else "", escape(describe(r)))
    console.print(fit_last_column(table))
    if listing.matched > len(rows):
        console.print(f"{len(rows)} of {listing.matched} matching records shown; --limit shows more", markup=False)


@app.command("show")
def show_cmd(
    record_id: Annotated[str, typer.Argument(help="Record id (or a unique prefix).")], json_out: JsonFlag = False
) -> None:
    """Show one record, everything it is related to, and its change history."""
    from orchestrator.lineage.store import record_payload
    from orchestrator.lineage.trace import describe

    store = _open()
    record = store.find(record_id)
    relations = store.relations(record.id)
    events = store.events(record.id)
    linked = _linked(store, record)
    parts_name, parts = _parts(store, record)
    patch = _patch(record)
    if json_out:
        doc = {
            "kind": record.kind,
            "record": record_payload(record),
            "relations": [record_payload(r) for r in relations],
            "linked": linked,
            "events": [
                {"seq": e.seq, "at": e.at, "action": e.action, "hash": e.hash, "changed": changed}
                for e, changed in zip(events, _event_changes(events), strict=True)
            ],
        }
        if parts_name:
            doc[parts_name] = [{"id": p.id, "summary": describe(p)} for p in parts]
        if patch is not None:
            doc["packages" if record.kind == "environment" else "patch"] = patch
        print_json(doc)
        return
    console.print(f"[bold]{record.kind}[/] {record.id}")
    payload = record_payload(record)
    if patch is not None and record.kind == "environment":  # the package list the hash stands for
        said = f"`{patch['apply']}` installs them" if patch["present"] else "not in this openlab home"
        payload["packages"] = f"{patch['path']}  ({said})"
    elif patch is not None:  # where the uncommitted changes are, beside their hash
        if patch["present"]:
            on = record.sha or "the commit"
            payload["patch"] = f"{patch['path']}  (`{patch['apply']}` on {on} rebuilds the tree)"
        else:
            payload["patch"] = f"{patch['path']}  (missing from this openlab home: `lineage verify` names it)"
    tasks = payload.pop("tasks", None)
    payload.pop("id", None)
    if isinstance(payload.get("command"), list):  # as a shell would take it: copied to run it again
        payload["command"] = shlex.join(str(part) for part in payload["command"])
    if isinstance(payload.get("used"), dict) and describe_usage(payload["used"]):
        payload["used"] = describe_usage(payload["used"])
    print_fields(payload)
    if isinstance(tasks, dict) and tasks:
        console.print(f"  {'tasks':<16}{len(tasks)}")
        for task, end in tasks.items():  # one line per array task: which shard failed, where
            console.print(f"    {task:<14}{describe_task(end)}", highlight=False, markup=False)
    if parts:  # a run's stages, a stage run's jobs: what `lineage show` is most often asked for
        console.print(f"[bold]{parts_name}[/]")
        for part in parts:
            say(f"  {part.id}  {describe(part)}")
    if linked:
        console.print("[bold]links[/]")
        for key, value in linked.items():
            say(f"  {key:<16}{value}")
    if relations:
        console.print("[bold]relations[/]")
        for rel in relations:
            if rel.subject_id == record.id:
                line = f"  {rel.relation} -> {rel.object_kind}:{rel.object_id} {rel.role}"
                other = (rel.object_kind, rel.object_id)
            else:
                line = f"  {rel.subject_kind}:{rel.subject_id} {rel.relation} -> this {rel.role}"
                other = (rel.subject_kind, rel.subject_id)
            say(line.rstrip())
            what = _what(store, *other)
            if what:  # which tokens, which commit: the related record in a few words, under its id
                say(f"      {what}")
    console.print(f"[bold]history[/] {len(events)} event(s)")
    for event, changed in zip(events, _event_changes(events), strict=True):
        what = "; ".join(f"{c['field']}: {_short(c['old'])} -> {_short(c['new'])}" for c in changed)
        say(
            f"  {event.seq}:{event.hash[:16]}  {event.at:%Y-%m-%d %H:%M:%S}  {event.action}"
            + (f"  {what}" if what else "")
        )
    if events:  # the full hash: an anchor `lineage verify --anchor` takes
        say(f"  last {events[-1].seq}:{events[-1].hash}")


#: Fields an update rewrites each time without a change of meaning: not listed as changes.
_BOOKKEEPING = frozenset({"updated_at"})


def _event_changes(events: list[Any]) -> list[list[dict[str, Any]]]:
    """Per event, the fields it changed from the record's previous event (none for a create): how a
    record came to say what it says, e.g. ``state: FAILED -> COMPLETED``, set after its run ended."""
    changes: list[list[dict[str, Any]]] = []
    before: dict[str, Any] | None = None
    for event in events:
        now = dict(event.payload or {})
        if before is None:
            changes.append([])
        else:
            keys = [k for k in now.keys() | before.keys() if k not in _BOOKKEEPING and now.get(k) != before.get(k)]
            changes.append([{"field": k, "old": before.get(k), "new": now.get(k)} for k in sorted(keys)])
        before = now
    return changes


def _short(value: Any, most: int = 60) -> str:
    text = repr(value) if not isinstance(value, dict | list) else json.dumps(value, default=str)
    return text if len(text) <= most else text[: most - 1] + "…"


@app.command("which")
def which_cmd(
    path: Annotated[
        Path, typer.Argument(parser=given_path, help="A file (a checkpoint, a shard) or a folder, wherever it is now.")
    ],
    json_out: JsonFlag = False,
) -> None:
    """Which recorded output holds this content: found by hash, so a copied or renamed checkpoint
    leads back to the output that had it, and `lineage trace` from there to what made it."""
    from orchestrator.lineage.trace import describe
    from orchestrator.lineage.which import holders
    from orchestrator.settings import load_settings

    store = _open()
    size = path.stat().st_size if path.is_file() else None
    what = f"{path} ({size / 2**30:.1f} GiB)" if size and size >= 2**30 else str(path)
    with console.status(f"hashing {what} and looking it up in the snapshot manifests…"):  # a terminal's spinner
        digest, found = holders(store, load_settings(), path)
    if json_out:
        print_json({"path": str(path), "blake3": digest, "holders": [h.to_dict() for h in found]})
        return
    if not found:
        raise NotFoundError(
            f"no recorded output holds {path}'s content (blake3 {digest[:16]}…); "
            "`openlab lineage show PATH` finds an output by where it was written"
        )
    for holder in found:
        where = f" as {holder.entry}" if holder.entry else ""
        for record in holder.records:
            say(f"{record.kind} {record.id} holds it{where}")
            console.print(Padding(Text(describe(record)), (0, 0, 0, 4)))
    say(f"what made it: openlab lineage trace {found[0].records[0].id}")


@app.command("trace")
def trace_cmd(
    record_id: Annotated[str, typer.Argument(help="Record id (or a unique prefix): an artifact, snapshot, run...")],
    down: Annotated[bool, typer.Option("--down", help="What came from it (default: what it came from).")] = False,
    depth: Annotated[int | None, typer.Option("--depth", min=1, help="At most this many hops (default: all).")] = None,
    json_out: JsonFlag = False,
    dot: Annotated[
        bool, typer.Option("--dot", help="Print a Graphviz graph, each record once: `| dot -Tsvg > lineage.svg`.")
    ] = False,
) -> None:
    """Everything a record came from (data, commit, environment, issue, W&B run, jobs), or with --down
    everything made from it: e.g. every checkpoint trained on a data snapshot."""
    from rich.console import Console
    from rich.text import Text
    from rich.tree import Tree

    from orchestrator.lineage.trace import TraceNode, describe, to_dot, trace

    if json_out and dot:
        raise ConfigError("give --json or --dot, not both")
    root = trace(_open(), record_id, direction="down" if down else "up", depth=depth)
    if json_out:
        print_json(root.to_dict())
        return
    if dot:
        sys.stdout.write(to_dot(root, "down" if down else "up"))
        return

    def label(node: TraceNode) -> str:
        how = f"[dim]{node.relation}{f' ({node.role})' if node.role else ''}[/] " if node.relation else ""
        if node.repeated:  # its id finds the first line, which says what it is: the tree stays readable
            return f"{how}[bold]{node.kind}[/] {node.id} [dim](shown above)[/]"
        text = f"{how}[bold]{node.kind}[/] {node.id} {escape(describe(node.record))}"
        if node.truncated:
            text += " [dim]…[/]"
        return text

    def text(node: TraceNode) -> Text:
        return Text.from_markup(label(node), overflow="fold")  # ids and paths are never cut short

    def add(branch: Tree, node: TraceNode) -> None:
        for child in node.children:
            add(branch.add(text(child)), child)

    tree = Tree(text(root))
    add(tree, root)
    # In a terminal long lines fold under their branch; piped, each record stays on one line for grep.
    out = console if console.is_terminal else Console(width=100_000, no_color=True, highlight=False)
    out.print(tree)


def _patch(record: Any) -> dict[str, Any] | None:
    """Where a dirty-tree commit's uncommitted changes are (the blob store holds the patch under its
    hash), whether they are there, and how to put them back; an environment's package list likewise;
    None for any other record."""
    from orchestrator.settings import load_settings

    if record.kind == "environment" and getattr(record, "packages_hash", None):
        blob = load_settings().blobs_dir / record.packages_hash
        return {"path": str(blob), "present": blob.is_file(), "apply": f"pip install -r {shlex.quote(str(blob))}"}
    if record.kind != "commit" or not getattr(record, "patch_hash", None):
        return None
    blob = load_settings().blobs_dir / record.patch_hash
    return {"path": str(blob), "present": blob.is_file(), "apply": f"git apply --binary {shlex.quote(str(blob))}"}


def _what(store: Any, kind: str, record_id: str) -> str:
    """A related record in a few words (``lineage list``'s summary); empty when the store no longer
    holds it (``lineage verify`` names that)."""
    from orchestrator.lineage.models import RECORD_TYPES
    from orchestrator.lineage.trace import describe

    model = RECORD_TYPES.get(kind)
    found = store.get(model, record_id) if model is not None else None
    return describe(found) if found is not None else ""


def _parts(store: Any, record: Any) -> tuple[str, list[Any]]:
    """A pipeline run's stage runs, or a stage run's attempts, in the order they started: the
    records that point at this one by their own field, so no relation lists them."""
    from sqlmodel import col

    from orchestrator.lineage.models import Attempt, StageRun

    if record.kind == "pipeline_run":
        return "stages", store.list(StageRun, pipeline_run_id=record.id, order_by=col(StageRun.started_at))
    if record.kind == "stage_run":
        return "attempts", store.list(Attempt, stage_run_id=record.id, order_by=col(Attempt.number))
    return "", []


def _linked(store: Any, record: Any) -> dict[str, str]:
    """GitHub issue and W&B run reachable from a record (directly or via its pipeline run)."""
    from orchestrator.lineage.models import GithubIssue, WandbRun

    ids = {record.id}
    pipeline_run_id = getattr(record, "pipeline_run_id", None)
    if pipeline_run_id:
        ids.add(pipeline_run_id)
    out: dict[str, str] = {}
    for rid in ids:
        for rel in store.relations(rid):
            other = rel.object_id if rel.subject_id == rid else rel.subject_id
            other_kind = rel.object_kind if rel.subject_id == rid else rel.subject_kind
            if other_kind == "github_issue" and "github" not in out:
                issue = store.get(GithubIssue, other)
                out["github"] = (issue.url or issue.id) if issue else other
            elif other_kind == "wandb_run" and rid == record.id:
                run = store.get(WandbRun, other)
                out.setdefault("wandb", (run.url or f"{run.mode} {run.local_dir}") if run else other)
    return out


@app.command("affected")
def affected_cmd(
    host: HostOpt = None,
    cluster: ClusterOpt = None,
    backend: BackendOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    json_out: JsonFlag = False,
) -> None:
    """What a machine (--host) or cluster (--cluster) touched: the stage runs with a job there, every
    output they made, and every later stage, output and run made from those, with the W&B runs
    those stages logged to.

    For the node found with bad GPU memory: `openlab lineage affected --host n17 --since 30d` is the
    list of checkpoints to distrust and the runs to redo. Any job there counts, a failed one too: a
    retry elsewhere may have resumed from what it wrote.
    """
    from orchestrator.lineage.affected import affected

    if not host and not cluster:
        raise ConfigError("say where: --host (a machine) or --cluster; see openlab lineage affected --help")
    report = affected(_open(), _record_filter(locals()))
    if json_out:
        print_json(report.to_dict())
        return
    if not report.made_there:
        say("no stage run had a job there" + (" in that time" if since or until else ""))
        return
    say(f"made there ({len(report.made_there)} stage run(s)):")
    for t in report.made_there:
        say(f"  {t.record.id}  {t.record.stage} {t.record.state}: {t.why}")
    say(f"outputs to distrust ({len(report.outputs)}):")
    for t in report.outputs:  # one gc or a re-run already removed is no file to distrust: said so
        gone = f"; removed {t.record.removed_at:%Y-%m-%d}" if getattr(t.record, "removed_at", None) else ""
        say(f"  {t.record.id}  {t.record.name} {t.record.uri}  ({t.why}{gone})")
    if report.stage_runs:
        say(f"later stage runs made from them ({len(report.stage_runs)}):")
        for t in report.stage_runs:
            say(f"  {t.record.id}  {t.record.stage} {t.record.state}  ({t.why})")
    say(f"pipeline runs affected ({len(report.pipeline_runs)}), each with the command that redoes it:")
    for t in report.pipeline_runs:
        run = t.record
        say(f"  {run.id}  {run.recipe or run.name}:{run.replica or '-'} {run.state}")
        say(f"    {report.rerun_command(run.id)}")
    if report.wandb_runs:
        say(f"W&B runs logged by them ({len(report.wandb_runs)}):")
        for t in report.wandb_runs:
            state = f" {t.record.state}" if t.record.state else ""
            say(f"  {t.record.url or t.record.id}{state}  ({t.why})")


@app.command("diff")
def diff_cmd(
    a: Annotated[str, typer.Argument(help="First stage run or pipeline run id (the earlier: changes read a -> b).")],
    b: Annotated[str, typer.Argument(help="Second stage run or pipeline run id.")],
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric",
            "-m",
            help="Also compare the metrics matching this shell pattern ('eval/*/loss', 'moe/drop_fraction', '*' "
            "for all), per stage: old -> new, the change and the change relative to old. Repeatable.",
        ),
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Say field by field what differs between two stage runs' identities (or two pipeline runs' stages),
    and with --metric how their results moved."""
    from orchestrator.lineage.diff import diff_records

    store = _open()
    left, right = store.find(a), store.find(b)
    sections = diff_records(store, left, right, metric or ())
    if json_out:
        out: dict[str, Any] = {
            "a": left.id,
            "b": right.id,
            "kind": left.kind,
            "changes": {s.name: s.fields for s in sections},
        }
        # how each stage ended where the two differ (COMPLETED against FAILED, with why)
        out["states"] = {s.name: s.states for s in sections if s.states}
        if metric:
            out["metrics"] = {s.name: [c.to_dict() for c in s.metrics] for s in sections if s.kind == "stage"}
        out["code_commits"] = {
            s.name: {
                "range": list(s.commit_range),
                "commits": [{"sha": c, "subject": m} for c, m in s.commits or []],
                "undone": [{"sha": c, "subject": m} for c, m in s.undone or []],
            }
            for s in sections
            if s.commit_range
        }
        print_json(out)
        return
    for section in sections:
        if section.only_in:  # a stage one of the runs did not run
            say(f"{section.name}: only in {section.only_in} (the other run did not run it: no metrics to compare)")
            continue
        if section.fields:
            console.print(f"[bold]{escape(section.name)}[/]: {len(section.fields)} field(s) differ")
        elif section.states:  # the same inputs, and one run's stage did not complete
            console.print(f"[bold]{escape(section.name)}[/]: identical inputs, ended differently")
        else:
            console.print(f"[green]{escape(section.name)}: identical[/]")
        if section.states:
            _print_states(section.states, left.id, right.id)
        for change in section.fields:
            say(f"  {change['path']}: {change['old']!r} -> {change['new']!r}")
        if section.commit_range:
            _print_code_commits(section)
        if metric and section.kind == "stage":  # the run section says what was asked: it has no metrics
            _print_metric_changes(section)


def _print_code_commits(section: Section) -> None:
    """The commits between the two runs that touched a stage's changed source files: where to bisect."""
    old, new = (c[:12] for c in section.commit_range or ("", ""))
    if section.commits is None:
        say(f"  code changed between {old} and {new} (not in this repository: no commit list)")
    elif section.commits or section.undone:
        if section.commits:
            console.print(f"  commits touching that code, {old}..{new}:", highlight=False, markup=False)
            for sha, subject in section.commits:
                say(f"    {sha[:12]} {subject}")
        if section.undone:  # the later run is on an older commit or another branch
            console.print(f"  undone (in {old}, not in {new}):", highlight=False, markup=False)
            for sha, subject in section.undone:
                say(f"    {sha[:12]} {subject}")
    else:  # the same commit, or commits that did not touch it: the difference is in a working tree
        say(f"  no commit {old}..{new} touches that code: it changed in an uncommitted working tree")


def _print_states(states: dict[str, Any], a: str, b: str) -> None:
    """``state: COMPLETED -> FAILED`` and, under it, why the one that did not complete did not."""
    say(f"  state: {states['old']} -> {states['new']}")
    for side, run in (("old", a), ("new", b)):
        if f"{side}_reason" in states:
            say(f"    {states[side]} in {run}: {states[f'{side}_reason'] or 'no reason recorded'}")


def _print_metric_changes(section: Section) -> None:
    """``metrics: 3 of 12 moved, 1 missing`` and one aligned line per metric that moved or that one
    side lacks (with which, and why: its stage failed) under a stage's field changes."""
    if not section.compared:
        console.print("  metrics: none matches --metric", highlight=False, markup=False)
        return
    moved, missing = section.moved, section.missing
    gone = f", {len(missing)} missing" if missing else ""
    console.print(f"  metrics: {len(moved)} of {section.compared} moved{gone}", highlight=False, markup=False)
    width = max((len(c.metric) for c in section.metrics), default=0)
    for c in section.metrics:
        old = "-" if c.old is None else format(c.old, ".6g")
        new = "-" if c.new is None else format(c.new, ".6g")
        if c.missing:
            change = f"  missing in {c.missing_in}{f' ({c.why})' if c.why else ''}"
        else:
            change = "" if c.delta is None else f"  ({c.delta:+.4g}"
            if change:
                change += ")" if c.relative is None else f", {c.relative:+.2%})"
        say(f"    {c.metric:<{width}}  {old} -> {new}{change}")


@app.command("compare")
def compare_cmd(
    runs: Annotated[list[str] | None, typer.Argument(help="Pipeline run ids (or unique prefixes).")] = None,
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric",
            "-m",
            help="Metrics to show, shell patterns ('eval/*/loss', '*' for all), STAGE:PATTERN for one stage's "
            "alone ('eval:eval/*/loss'). Repeatable. Default: eval's losses and repro's late-window drops "
            "(runs that stopped before them: their last stage's held-out losses).",
        ),
    ] = None,
    state: StateOpt = None,
    recipe: RecipeOpt = None,
    replica: ReplicaOpt = None,
    backend: BackendOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    commit: CommitOpt = None,
    issue: IssueOpt = None,
    host: HostOpt = None,
    cluster: ClusterOpt = None,
    user: UserOpt = None,
    trigger: TriggerOpt = None,
    sweep: SweepOpt = None,
    limit: Annotated[
        int | None,
        typer.Option("--limit", "-n", min=1, help="At most this many runs (the newest); default 20, a sweep's all."),
    ] = None,
    sort: Annotated[
        str | None,
        typer.Option("--sort", help="Order the runs by this metric column, smallest first (the best loss on top)."),
    ] = None,
    over: OverOpt = None,
    json_out: JsonFlag = False,
) -> None:
    """Several pipeline runs side by side, oldest first (or --sort by a metric): the values that vary
    among them (each value --set, backend, commit) and the metrics they measured, e.g. a sweep of pretrain.lr.

    The runs given, plus those the filters of `lineage list` pick (`--replica tiny --since 1d`).
    """
    from orchestrator.lineage.compare import DEFAULT_METRICS, compare_runs
    from orchestrator.lineage.listing import list_records
    from orchestrator.lineage.models import PipelineRun

    store = _open()
    picked = []
    for ref in runs or ():
        record = store.find(ref)
        if not isinstance(record, PipelineRun):
            raise ConfigError(f"{ref} is a {record.kind}, not a pipeline run: compare takes runs (prun_…)")
        picked.append(record)
    flt = _record_filter(locals())
    if flt.given():
        most = limit or (None if sweep else 20)  # a sweep is compared whole
        found = list_records(store, ["pipeline_run"], flt, limit=most).records
        if not found:
            raise NotFoundError(
                "no pipeline run matches these filters; `openlab lineage list -k pipeline_run` shows runs"
            )
        picked += found
    if not picked:
        raise ConfigError("give pipeline run ids, or filters that pick runs (e.g. --replica tiny --since 1d)")
    comparison = compare_runs(store, picked, metric or DEFAULT_METRICS)
    if metric:
        comparison.check_picked(metric)
    shown = comparison.over(over) if over else comparison
    if sort is not None:
        shown = shown.sorted_by(sort)
    if json_out:
        print_json(shown.to_dict())
        return
    print_comparison(shown, metric is None)


def print_comparison(comparison: Any, default_metrics: bool) -> None:
    """A table of the runs (below 110 columns: a block per run, one value a line), or of the groups
    of runs of a comparison taken over a value (:class:`~orchestrator.lineage.compare.Aggregate`)."""
    from orchestrator.lineage.compare import Aggregate, asked_word

    if isinstance(comparison, Aggregate):
        _print_aggregate(comparison, default_metrics)
        return

    def value(row: Any, key: str) -> str:
        return asked_word(row.asked, key)

    def number(row: Any, column: tuple[str, str]) -> str:
        got = row.metrics.get(column)
        return "-" if got is None else format(got, ".6g")

    # A table only where every column fits whole (numbers are compared across rows: never folded)
    widths = [25, 16, 9]
    widths += [max([len(key)] + [len(value(row, key)) for row in comparison.rows]) for key in comparison.varies]
    widths += [
        max([len(comparison.label(c))] + [len(number(row, c)) for row in comparison.rows]) for c in comparison.columns
    ]
    if narrow() or sum(widths) + 3 * len(widths) > console.width:  # padding each side and a rule between
        for row in comparison.rows:
            say(f"{row.run.id}  {row.run.started_at:%Y-%m-%d %H:%M}  {row.run.state}")
            for key in comparison.varies:
                say(f"    {key}: {value(row, key)}")
            for column in comparison.columns:
                say(f"    {comparison.label(column)}: {number(row, column)}")
    else:
        table = compact_table("openlab lineage compare")
        table.add_column("run", no_wrap=True)
        table.add_column("started", no_wrap=True)
        table.add_column("state", no_wrap=True)
        for key in comparison.varies:  # a heading whole (up to 40 characters); a long value folds under it
            table.add_column(escape(key), overflow="fold", min_width=min(len(key), 40))
        for column in comparison.columns:
            table.add_column(escape(comparison.label(column)), justify="right", overflow="fold")
        for row in comparison.rows:
            table.add_row(
                row.run.id,
                f"{row.run.started_at:%Y-%m-%d %H:%M}",
                row.run.state,
                *(escape(value(row, key)) for key in comparison.varies),
                *(number(row, column) for column in comparison.columns),
            )
        console.print(table)
    if comparison.note:
        say(comparison.note)
    if not comparison.varies and len(comparison.rows) > 1:
        say("the runs were asked the same (no value set, backend, recipe, replica or commit differs)")
    _say_if_no_metric(comparison.columns, default_metrics)


def _say_if_no_metric(columns: list[Any], default_metrics: bool) -> None:
    if not columns:
        hint = "add -m PATTERN ('*' for all)" if default_metrics else "'*' shows all"
        say(f"no metric of these runs matches the patterns; {hint}")


def _print_aggregate(aggregate: Any, default_metrics: bool) -> None:
    """``compare --over seed``: a row per group, its values, its runs, each metric's mean ± spread."""
    from orchestrator.lineage.compare import asked_word

    of = aggregate.of

    def value(group: Any, key: str) -> str:
        return asked_word(group.rows[0].asked, key)

    over = ", ".join(k.removeprefix("set.") for k in aggregate.over)
    widths = [6, *(max([len(k)] + [len(value(g, k)) for g in aggregate.groups]) for k in aggregate.varies)]
    widths += [max([len(of.label(c))] + [len(g.spread(c)) for g in aggregate.groups]) for c in of.columns]
    if narrow() or sum(widths) + 3 * len(widths) > console.width:
        for group in aggregate.groups:
            values = " ".join(f"{k}={value(group, k)}" for k in aggregate.varies) or "(all)"
            say(f"{values}  {len(group.rows)} run{'s' if len(group.rows) != 1 else ''} over {over}")
            for column in of.columns:
                say(f"    {of.label(column)}: {group.spread(column)}")
    else:
        table = compact_table("openlab lineage compare")
        for key in aggregate.varies:
            table.add_column(escape(key), overflow="fold", min_width=min(len(key), 40))
        table.add_column("runs", justify="right", no_wrap=True)
        for column in of.columns:
            table.add_column(escape(of.label(column)), justify="right", overflow="fold")
        for group in aggregate.groups:
            table.add_row(
                *(escape(value(group, k)) for k in aggregate.varies),
                str(len(group.rows)),
                *(group.spread(c) for c in of.columns),
            )
        console.print(table)
    say(aggregate.legend)
    if of.note:
        say(of.note)
    _say_if_no_metric(of.columns, default_metrics)


@app.command("verify")
def verify_cmd(
    anchor: Annotated[
        list[str] | None,
        typer.Option(
            "--anchor",
            help="SEQ:HASH of an event published outside the database (a lineage card prints one): "
            "the log must still hold it. Repeatable.",
        ),
    ] = None,
    github_anchors: Annotated[
        bool,
        typer.Option(
            "--github-anchors",
            help="Also check the anchor of every run card posted on GitHub, read back from GitHub (needs a token).",
        ),
    ] = False,
    json_out: JsonFlag = False,
) -> None:
    """Re-hash data and artifacts, re-walk the event chain and check commits; exit 1 if anything is broken.

    The chain shows nothing was changed piecemeal; an anchor published elsewhere (each run's card
    on its experiment issue carries the event that recorded the run's start) also shows the log
    was not rewritten as a whole, hashes recomputed, since then.
    """
    from orchestrator.lineage.store import LineageStore
    from orchestrator.lineage.verify import Problem, head_anchor, parse_anchor, verify
    from orchestrator.settings import load_settings

    settings = load_settings()
    anchors = [parse_anchor(text) for text in anchor or []]
    store = LineageStore.open(settings, create=False)
    notes: list[str] = []
    unchecked: list[Problem] = []
    if github_anchors:
        from orchestrator.links.github import GithubLinker

        linker = GithubLinker(store, settings=settings)
        if json_out or not console.is_terminal:
            published = linker.published_anchors()
        else:
            with console.status("reading the run cards' anchors back from GitHub…"):
                published = linker.published_anchors()
        anchors += published.anchors
        notes = published.without_anchor
        # asked to check them and could not: that is not a pass
        unchecked = [Problem("card", line) for line in published.unreadable]
    unseen: list[str] = []  # outputs whose artifact root is not on this machine: not checked, not passed
    if json_out or not console.is_terminal:
        problems = verify(store, settings, anchors=anchors, notes=unseen)
    else:
        with console.status("verifying lineage…") as status:
            problems = verify(
                store,
                settings,
                anchors=anchors,
                progress=lambda what: status.update(f"verifying {what}"),
                notes=unseen,
            )
    notes += unseen
    problems += unchecked
    head = head_anchor(store)
    if json_out:
        print_json(
            {
                "ok": not problems,
                "problems": [p.to_dict() for p in problems],
                "anchors": [{"anchor": str(a), "where": a.where} for a in anchors],
                "head": str(head) if head is not None else None,
                "notes": notes,
            }
        )
        raise typer.Exit(1 if problems else 0)
    for note in notes:
        say(f"note: {note}")
    if problems:
        console.print(f"[bold red]{len(problems)} problem(s)[/]")
        for p in problems:
            say(f"  {p}")
    else:
        held = f"; {len(anchors)} published anchor(s) held" if anchors else ""
        # outputs on another machine's storage, commits of a repository not here, were not checked: the
        # line claims only what was
        commits_away = any(re.match(r"\d+ commits? not on this machine", note) for note in unseen)
        data_away = any(not re.match(r"\d+ commits? not on this machine", note) for note in unseen)
        data = ", ".join(
            (
                "commits present where their repository is on this machine" if commits_away else "commits present",
                "data present where it is on this machine" if data_away else "data present",
            )
        )
        console.print(f"[green]lineage verified: event chain intact, records match their log, {data}{held}[/]")
        if head is not None:  # the chain cannot show its latest events cut off: an anchor published now can
            say(
                f"head {head}: publish it; `openlab lineage verify --anchor {head}` later proves the log still holds it"
            )
    raise typer.Exit(1 if problems else 0)


@app.command("reconcile")
def reconcile_cmd(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only say what would be closed and cancelled; change nothing.")
    ] = False,
    json_out: JsonFlag = False,
) -> None:
    """Close runs a dead orchestrator left RUNNING and cancel their orphaned jobs, now.

    Every pipeline start does this too; run it after a crash to free a cluster's GPUs without
    starting another pipeline. Only runs whose lease has expired (90 s after their orchestrator's
    last heartbeat) are touched, so a live orchestrator's runs are safe.
    """
    from orchestrator.pipeline.reconcile import reconcile_all
    from orchestrator.settings import load_settings

    settings = load_settings()
    store = _open()
    quiet = logging.getLogger("openlab.pipeline")  # its warnings say what is printed below, a second time
    level, quiet.level = quiet.level, logging.ERROR
    try:
        report = reconcile_all(store, settings=settings, dry_run=dry_run)
    finally:
        quiet.level = level
    if json_out:
        print_json(report.to_dict())
        return
    if not report:
        console.print("[green]nothing to reconcile: every RUNNING run has a live orchestrator[/]")
        return
    for line in report.lines():
        say(line)


@app.command("usage")
def usage_cmd(
    by: Annotated[
        str,
        typer.Option(
            "--by",
            "-b",
            help="Group by recipe, replica, stage, backend, cluster, user, trigger, sweep, state, day or pipeline_run.",
        ),
    ] = "recipe",
    state: StateOpt = None,
    stage: Annotated[list[str] | None, typer.Option("--stage", help="Only jobs of this stage.")] = None,
    recipe: RecipeOpt = None,
    replica: ReplicaOpt = None,
    backend: BackendOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    commit: CommitOpt = None,
    issue: IssueOpt = None,
    host: HostOpt = None,
    cluster: ClusterOpt = None,
    user: UserOpt = None,
    trigger: TriggerOpt = None,
    sweep: SweepOpt = None,
    json_out: JsonFlag = False,
) -> None:
    """What the jobs used: attempts, wall hours, CPU- and GPU-hours asked, the hours lost, and what was used.

    `openlab lineage usage --replica small --since 30d --by stage` answers "what did the nightlies
    cost this month, and where"; lost hours are those of attempts that failed, were preempted or
    were cancelled. CPU- and GPU-hours are hours times what each job asked for: CPUs per task times
    tasks, GPUs per node times nodes (a job that asked for no CPU count counts one per task). The
    filters are those of `lineage list`.
    """
    from orchestrator.lineage.usage import usage

    flt = _record_filter(locals())
    report = usage(_open(), flt, by=by)
    if json_out:
        print_json({"by": report.by, "groups": [g.to_dict() for g in report.groups], "total": report.total.to_dict()})
        return
    if not report.groups:
        console.print("no jobs match", markup=False)
        return
    rows = [
        [
            escape(g.group),
            str(g.attempts),
            " ".join(f"{n} {s.lower()}" for s, n in sorted(g.by_state.items())),
            _hours(g.wall_hours),
            _hours(g.cpu_hours),
            _hours(g.gpu_hours),
            _hours(g.lost_hours),
            _used(g),
            f"{g.peak_rss_bytes / 2**30:.2f} GiB" if g.peak_rss_bytes is not None else "-",
        ]
        for g in [*report.groups, report.total]
    ]
    if narrow():  # nine columns do not fit 80: a block per group, its name whole, each figure named
        _usage_blocks(by, rows)
        return
    # Each column at least as wide as its widest word ("completed", not "complete" and "d").
    table = compact_table(f"job usage by {by}")
    table.add_column(by, overflow="fold", min_width=min(12, max(len(r[0]) for r in rows)))
    for i, header in enumerate(("jobs", "by state", "wall h", "CPU-h", "GPU-h", "lost h", "CPU-h used", "peak mem"), 1):
        widest = max(len(word) for r in rows for word in r[i].split())
        justify = "left" if header == "by state" else "right"
        table.add_column(header, justify=justify, overflow="fold", min_width=widest)
    for g, row in zip([*report.groups, report.total], rows, strict=True):
        table.add_row(*row, style="bold" if g is report.total else None, end_section=g is report.groups[-1])
    console.print(table)


def _usage_blocks(by: str, rows: list[list[str]]) -> None:
    """``lineage usage`` below 110 columns: per group (the total last) a line with its name and its
    jobs by state, then one with each figure named. Names stay whole (a recipe name folded in two
    read as two), and a number is never cut."""
    console.print(f"job usage by {by}", style="italic", highlight=False)
    for i, (group, jobs, states, wall, cpu, gpu, lost, used, peak) in enumerate(rows):
        name = "total" if i == len(rows) - 1 else group
        say(f"{name}  {jobs} job{'s' if jobs != '1' else ''}: {states}")
        say(f"    wall {wall} h · CPU {cpu} h · GPU {gpu} h asked · lost {lost} h")
        if used == "-":
            say("    measured: none of these jobs")
        else:  # what the measured jobs used, of what those jobs asked
            say(f"    measured: CPU {used.replace(' of ', ' h used of ')} h asked · peak memory {peak}")


def _used(g: Any) -> str:
    """CPU-hours the measured jobs used, of what those jobs asked (``-`` when none was measured)."""
    if not g.measured:
        return "-"
    share = f" of {_hours(g.cpu_hours_asked_measured)}" if g.cpu_hours_asked_measured else ""
    return f"{_hours(g.cpu_hours_used)}{share}"


def _hours(value: float) -> str:
    """Hours to two decimals, or two significant digits below 0.1 (a minute-long job is not 0.00)."""
    if value == 0 or value >= 0.1:
        return f"{value:.2f}"
    digits = 1 - math.floor(math.log10(abs(value)))  # two significant digits, never "6e-05"
    return f"{value:.{digits}f}"


@app.command("export")
def export_cmd(
    runs: Annotated[
        list[str] | None, typer.Argument(help="Pipeline run ids (or unique prefixes); none exports everything.")
    ] = None,
    fmt: Annotated[
        str,
        typer.Option(
            "--format", "-f", help="prov (W3C PROV-JSON), openlineage (JSON lines) or ro-crate (a directory)."
        ),
    ] = "prov",
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", help="Write to this file (ro-crate: this new directory); - is stdout."),
    ] = None,
    namespace: Annotated[str, typer.Option(help="OpenLineage job namespace.")] = "openlab",
    state: StateOpt = None,
    recipe: RecipeOpt = None,
    replica: ReplicaOpt = None,
    backend: BackendOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    commit: CommitOpt = None,
    issue: IssueOpt = None,
    host: HostOpt = None,
    cluster: ClusterOpt = None,
    user: UserOpt = None,
    trigger: TriggerOpt = None,
    sweep: SweepOpt = None,
) -> None:
    """Export lineage as W3C PROV-JSON, OpenLineage RunEvents or a Workflow Run RO-Crate, secrets masked.

    The filters pick pipeline runs as `lineage list` does (`--recipe marin --replica drops --since
    30d`: last month's drop nightlies, for an archive); runs given by id are added to them.
    """
    from pathlib import Path

    from orchestrator.lineage.export import FORMATS, export
    from orchestrator.lineage.listing import list_records
    from orchestrator.snapshots import atomic_write

    if fmt not in (*FORMATS, "ro-crate"):
        raise ConfigError(f"unknown export format {fmt!r}; {choices(fmt, (*FORMATS, 'ro-crate'), label='formats')}")
    if output is not None and not output.strip():
        raise ConfigError("--output is empty: give a file (a directory for ro-crate), or leave it out for stdout")
    flt = _record_filter(locals())
    if flt.given():
        picked = list_records(_open(), ["pipeline_run"], flt, limit=None).records
        if not picked:  # no run is not "every run": an empty selection must not export the whole store
            raise NotFoundError(
                "no pipeline run matches these filters; `openlab lineage list -k pipeline_run` shows runs"
            )
        runs = [*(runs or ()), *(r.id for r in picked)]
    if fmt == "ro-crate":
        from orchestrator.lineage.rocrate import write_rocrate

        if output is None or output == "-":
            raise ConfigError("--format ro-crate writes a directory: add --output DIR (not stdout)")
        crate = write_rocrate(_open(), runs or (), Path(output))
        console.print(f"wrote RO-Crate to {crate}/ (ro-crate-metadata.json)", highlight=False)
        return
    text = export(_open(), fmt, runs or (), namespace=namespace)
    if output is None or output == "-":  # `-o -` is stdout, as for curl and tar: not a file named "-"
        print(text, end="")
        return
    if Path(output).is_dir():  # atomic_write's error named its own temporary file beside it
        raise ConfigError(f"--output {output} is a folder: give a file to write ({fmt} is one file)")
    target = Path(output)
    try:
        if target.exists() and not target.is_file():
            # /dev/null, /dev/stdout, a named pipe: written into, as curl -o and tar -f do. Replaced by a
            # temporary file, a pipe's reader got nothing, and as root /dev/null would become a regular file.
            with target.open("wb") as stream:
                stream.write(text.encode())
        else:
            atomic_write(target, text.encode())  # a reader never sees half an export
    except OSError as exc:  # named by what refused: a folder above it (a file there), else the path given
        above = exc.filename and Path(exc.filename) in Path(output).parents
        where = f"{exc.filename}: " if above else ""
        raise ConfigError(
            f"cannot write {output}: {where}{exc.strerror or exc}; give a file in a folder you can write"
        ) from None
    console.print(f"wrote {fmt} export to {output}", highlight=False)
