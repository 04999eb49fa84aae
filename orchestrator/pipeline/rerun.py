"""A pipeline run asked again (``openlab rerun PRUN``): what it was asked, read back from its record.

After a failure is fixed (a node drained, a bug patched, a quota raised), the person who reads
"FAILED" in ``lineage list`` or a nightly's card should not have to rebuild the command that
started it: recipe, replica, the values set for it, where it stopped (``--until``), its
backend, its issue, its sweep. Prefect's *Retry* does this for a flow run; this is the same for
any run, from a terminal. The new run is recorded as the old one's retry (``params.retry_of``,
``wasInformedBy`` with role ``retry-of``), like Prefect's, so the recovery is not a new,
unrelated run; what it reuses and resumes follows from stage identities, as always.

The run's *asks* are read back, not its code: the recipe is this tree's, by name (a recipe file
given by path is read from that path), so a fix to the code or the recipe is what runs; a run the
UI made at another ``git_ref`` is rerun on this tree, which the rerun says. Its
``force`` is not carried over (a rerun of a forced run would re-run everything again): the
rerun takes its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.lineage.models import PipelineRun
from orchestrator.lineage.store import LineageStore
from orchestrator.recipes import ResolvedRecipe, find_recipe, resolve


@dataclass(frozen=True)
class Rerun:
    """What a recorded pipeline run asked, resolved against this tree: ready to start again."""

    #: The run asked again.
    of: PipelineRun
    recipe: ResolvedRecipe
    backend: str
    issue: str | None
    #: The stage it stopped after (``--until``); None when it ran the replica whole.
    until: str | None
    #: Parameters the new run records as the old one did (its sweep: the retry stays one of its runs).
    params: dict[str, Any] = field(default_factory=dict)
    #: Whether the run required its issue link (``--require-issue``, the UI's ``require_issue``).
    issue_required: bool = False
    #: The git ref the run ran (a UI run's ``git_ref``) when not the working tree: the rerun runs this tree.
    git_ref: str | None = None


def rerun_of(store: LineageStore, run_id: str, *, root: Path | None = None) -> Rerun:
    """The run ``run_id`` asked again: its recipe (this tree's, by name), replica, values set,
    stages, backend, issue and sweep. One-line errors for an id that names no pipeline run, or
    a run that was not a recipe's (a pipeline built in code records no recipe to run again)."""
    run = store.find(run_id)  # any record's id: a stage run's is refused naming what it is
    if not isinstance(run, PipelineRun):
        raise ConfigError(f"{run_id} is a {run.kind}, not a pipeline run: rerun takes runs (prun_…)")
    asked = (run.params or {}).get("recipe") or {}
    if not asked.get("recipe"):
        raise ConfigError(
            f"{run.id} records no recipe (a pipeline started from code): start it again as it was started"
        )
    name, path = str(asked["recipe"]), asked.get("recipe_path")
    try:  # this tree's recipe of that name; else the file the run read, where it is not one of the tree's
        ref = find_recipe(name, root=root)
    except ConfigError:
        if not path or not Path(path).is_file():
            raise
        ref = Path(path)
    resolved = resolve(ref, asked.get("replica"), root=root, sets=asked.get("run_set") or {})
    stages = list(asked.get("stages") or resolved.stages)
    until = stages[-1] if tuple(stages) != tuple(resolved.stages) else None
    if until is not None and until not in resolved.stages:
        raise ConfigError(
            f"{run.id} stopped after {until}, which is no longer a stage of {resolved.name}: "
            f"run `openlab run {name}{_replica_flag(resolved)} --until STAGE` instead"
        )
    params = {"sweep": dict(run.sweep)} if run.sweep else {}
    issue = (run.params or {}).get("issue") or None
    ref = (run.params or {}).get("git_ref")
    git_ref = str(ref) if ref and ref != "HEAD" else None
    required = bool(issue and ((run.params or {}).get("issue_required") or (run.params or {}).get("require_issue")))
    return Rerun(run, resolved.until(until), run.backend, issue, until, params, required, git_ref)


def _replica_flag(resolved: ResolvedRecipe) -> str:
    return f" -r {resolved.replica}" if resolved.replica else ""


__all__ = ["Rerun", "rerun_of"]
