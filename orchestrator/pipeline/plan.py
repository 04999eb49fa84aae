"""The dry run: for each stage, run or reuse, and why (Marin #2219: say which change invalidated a hash).

:func:`plan` computes each stage's identity exactly as :func:`execute_stage` would — same
config, same code tree hashes, same environment fields — and looks up lineage without
writing a record. Downstream of a stage that will run, the input's content is not known
yet; that stage is reported ``depends`` when nothing else in its identity changed (it is
reused if the upstream re-run produces byte-identical output) and ``run`` otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.cards import md_cell
from orchestrator.identity import compute_identity, diff_identities, source_file
from orchestrator.lineage import leases
from orchestrator.lineage.store import LineageStore
from orchestrator.pipeline.dag import Pipeline, moe_pipeline
from orchestrator.pipeline.execute import backend_environments, environment_values, stage_environment
from orchestrator.pipeline.reuse import (
    NO_LONGER_VERIFY,
    closest_completed,
    describe_changes,
    find_reusable,
    known_fields,
    latest_completed,
    unchanged_since,
)
from orchestrator.recipes import ResolvedRecipe, identity_config
from orchestrator.settings import Settings, load_settings

#: Plan actions.
ACTIONS = ("reuse", "run", "wait", "depends")


@dataclass
class StagePlan:
    """What :func:`execute_stage` would do for one stage, and why."""

    stage: str
    action: str
    reason: str
    identity: str | None = None
    #: Identity fields that differ from ``previous`` (the last completed run of the stage).
    changes: list[str] = field(default_factory=list)
    #: ``sha subject`` of each commit since the previous run's that touched a changed source file
    #: of this stage, newest first (and a last line when the working tree changes it too).
    commits: list[str] = field(default_factory=list)
    previous: str | None = None
    reused_from: str | None = None
    lease_holder: str | None = None
    #: Inputs whose content is unknown until an upstream stage runs.
    pending_inputs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "action": self.action,
            "reason": self.reason,
            "identity": self.identity,
            "changes": list(self.changes),
            "commits": list(self.commits),
            "previous": self.previous,
            "reused_from": self.reused_from,
            "lease_holder": self.lease_holder,
            "pending_inputs": list(self.pending_inputs),
        }


def plan(
    pipeline: Pipeline,
    configs: Mapping[str, Mapping[str, Any]],
    *,
    settings: Settings | None = None,
    store: LineageStore | None = None,
    force: bool | frozenset[str] = False,
    recipe: str | None = None,
    replica: str | None = None,
    backend: str = "local",
) -> list[StagePlan]:
    """Say, for every stage, reuse / run / wait / depends and which identity fields changed.

    ``backend`` matters: on a container backend a stage's environment is its image.
    """
    from orchestrator.provenance import capture

    pipeline.check_forced(force)
    settings = settings or load_settings()
    owns = store is None
    store = store or LineageStore.open_to_plan(settings)
    try:
        prov = capture(pipeline.repo_root, pipeline.code_paths(), settings=settings, keep_patch=False)
        env_fields = sorted({f for s in pipeline.stages for f in s.environment_fields})
        env_values = environment_values(prov, env_fields)
        # the run's own checks (refused as the run would be), and each stage's environment image
        images = {b: e.image for b, e in backend_environments(pipeline, backend, settings).items()}
        tree = pipeline.code_tree(prov.git.tree_hashes, prov.git.reason)
        known: dict[str, str | None] = {}  # stage -> input hash of its output (None: unknown until it runs)
        plans: list[StagePlan] = []
        for spec in pipeline.stages:
            pending = [key for key, up in spec.inputs.items() if known.get(up) is None]
            inputs = {key: str(known[up]) for key, up in spec.inputs.items() if known.get(up) is not None}
            identity = compute_identity(
                spec.name,
                identity_config(configs[spec.name], spec.tasks),
                inputs=inputs,
                code={p: tree[p] for p in spec.code_paths},
                environment=stage_environment(spec, images[spec.backend or backend], env_values),
            )
            forced = force is True or (not isinstance(force, bool) and spec.name in force)
            previous = closest_completed(
                store,
                spec.name,
                identity.fields(),
                exclude_identity=None if pending else identity.digest,
                recipe=recipe,
                replica=replica,
                unknown_inputs=pending,
            )
            changes: list[str] = []
            if previous is not None:
                # what is known: pending inputs are judged after upstream runs
                fields = diff_identities(known_fields(previous.identity_fields, pending), identity.fields())
                changes = describe_changes(fields)
                code = [f for c in fields if (f := source_file(c.path))]
                commits = _commits_since(store, previous, prov.git, code) if code else []
            else:
                commits = []
            item = StagePlan(
                stage=spec.name,
                action="run",
                reason="",
                identity=None if pending else identity.digest,
                changes=changes,
                commits=commits,
                previous=previous.id if previous is not None else None,
                pending_inputs=pending,
            )
            if pending:
                ups = ", ".join(sorted({spec.inputs[k] for k in pending}))
                if forced:
                    item.reason = "forced"
                elif previous is None:
                    item.reason = "no earlier completed run of this stage"
                elif changes:
                    item.reason = f"changed since {previous.id}: " + "; ".join(changes[:6])
                else:
                    item.action = "depends"
                    item.reason = (
                        f"nothing of its own changed; {ups} runs first, and this stage is reused "
                        f"if that output is byte-identical to what {previous.id} used"
                    )
                known[spec.name] = None
                plans.append(item)
                continue
            why = ""
            if not forced:
                original, why = find_reusable(store, identity.digest, settings)
                if original is not None:
                    item.action, item.reason, item.reused_from = "reuse", why, original.id
                    item.changes, item.commits = [], []
                    item.previous = original.id
                    out = original.outputs.get("out") or {}
                    known[spec.name] = out.get("input_hash") or out.get("content_hash")
                    plans.append(item)
                    continue
            lease = leases.current(store, identity.digest)
            if leases.is_live(lease) and not forced:
                item.action = "wait"
                item.lease_holder = lease.holder if lease is not None else None
                item.reason = (
                    f"identity {identity.digest[:16]} is being run by {item.lease_holder}; will reuse its result"
                )
            elif forced and (same := latest_completed(store, identity.digest)) is not None:
                item.reason = f"forced; {unchanged_since(identity.digest, same)}"  # what changed elsewhere is not why
                item.changes, item.commits, item.previous = [], [], same.id
            elif forced:
                item.reason = "forced"
            elif why.startswith(NO_LONGER_VERIFY):  # same identity, but its outputs are gone or changed
                item.reason = why
            elif previous is None:
                item.reason = "no earlier completed run of this stage"
            else:
                item.reason = f"changed since {previous.id}: " + "; ".join(changes[:6])
            known[spec.name] = None
            plans.append(item)
        return plans
    finally:
        if owns:
            store.close()


def _commits_since(store: LineageStore, previous: Any, git: Any, paths: list[str]) -> list[str]:
    """What changed ``paths`` since ``previous`` ran: the commits from its commit to HEAD that
    touched them, those its commit had and HEAD lacks, and the working tree when it changes them
    too. Empty when that cannot be told (the previous run's commit is not in this repository)."""
    from orchestrator.lineage.diff import commit_of
    from orchestrator.provenance.git import commits_touching, uncommitted

    then = commit_of(store, previous)
    if then is None or not then.sha or not git.commit or not git.root:
        return []
    found = commits_touching(git.root, then.sha, git.commit, paths)
    if found is None:
        return []
    undone = commits_touching(git.root, git.commit, then.sha, paths) or []
    lines = [f"{sha[:12]} {subject}" for sha, subject in found]
    # the other way: commits the previous run had that HEAD lacks (an older checkout, another branch)
    lines += [f"{sha[:12]} {subject} (undone: the previous run had it)" for sha, subject in undone]
    if git.dirty and uncommitted(git.root, paths):
        lines.append("uncommitted changes in the working tree")
    return lines


def explain_recipe(
    recipe: str | Path | ResolvedRecipe,
    replica: str | None = None,
    *,
    settings: Settings | None = None,
    store: LineageStore | None = None,
    force: bool | frozenset[str] = False,
    repo_root: Path | None = None,
    backend: str = "local",
) -> list[StagePlan]:
    """The dry run of ``openlab run RECIPE --replica R --backend B``."""
    from orchestrator.recipes import resolve

    resolved = recipe if isinstance(recipe, ResolvedRecipe) else resolve(recipe, replica, root=repo_root)
    return plan(
        moe_pipeline(repo_root, stages=resolved.stages, resources=resolved.resources),
        resolved.stage_configs,
        settings=settings,
        store=store,
        force=force,
        recipe=resolved.recipe.name,
        replica=resolved.replica,
        backend=backend,
    )


def plan_markdown(title: str, plans: list[StagePlan]) -> str:
    """The dry run as markdown (a Prefect artifact): the table ``openlab explain`` prints, plus a tally.

    Same columns as the terminal — stage, action, identity, why, changed fields — so a person
    who pressed *dry run* in the UI reads what a person at a terminal reads.
    """
    tally = ", ".join(f"{sum(p.action == a for p in plans)} {a}" for a in ACTIONS if any(p.action == a for p in plans))
    lines = [
        f"**{md_cell(title)}** — nothing launched: {tally or 'no stages'}",
        "",
        "| stage | action | identity | why | changed fields |",
        "|---|---|---|---|---|",
    ]
    for p in plans:
        changed = "<br>".join([*(md_cell(c) for c in p.changes), *(f"by {md_cell(c)}" for c in p.commits)]) or "-"
        identity = f"`{p.identity[:16]}`" if p.identity else "(after upstream)"
        lines.append(f"| {p.stage} | **{p.action}** | {identity} | {md_cell(p.reason)} | {changed} |")
    return "\n".join(lines) + "\n"


__all__ = ["ACTIONS", "StagePlan", "explain_recipe", "plan", "plan_markdown"]
