"""Adopt outputs made outside openlab as a stage's: the corpus or checkpoint a lab already has.

A lab that starts using openlab has data it built and checkpoints it trained before. Running
those stages again to get them into lineage costs days of GPUs; pretending they never existed
loses them. ``openlab adopt RECIPE --replica R --stage S PATH`` says instead: *this folder is
what stage S of this recipe would produce here*, and records that claim as such:

- The stage's identity is computed exactly as a run would (config, the upstream stages'
  outputs, the code's tree hashes, the environment), so the next ``openlab run`` of the recipe
  reuses the adopted folder and runs only what comes after it. The stages before S must already
  be completed (run or adopted): their outputs are part of S's identity.
- The folder is copied (``move=True``: renamed, on one filesystem) into the identity's output
  folder, hashed like any output, and recorded in one transaction: a pipeline run with trigger
  ``adopt`` (its ``params.adopt`` names the source, who adopted it and when), a COMPLETED stage
  run whose output says ``adopted_from`` and ``adopted_by``, and the artifact (and data snapshot,
  for a data stage). Nothing is recorded when the copy or the hashing fails, and a partial copy
  is removed; if the recording fails, the folder goes back to where it was.
- It is refused when the identity already has completed outputs that verify (there is nothing
  to adopt), when another run holds the identity's lease, and for a source inside openlab's own
  artifacts (that is a reuse, not an adoption).

What openlab cannot check is that the folder really is what the code would make: the record
says it was adopted and from where, which is what an auditor needs to weigh it.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError, OpenlabError
from orchestrator.lineage import leases
from orchestrator.lineage.models import Artifact, StageRun, new_id, utcnow
from orchestrator.lineage.record import live_records_at, mark_removed
from orchestrator.pipeline.execute import (
    PipelineContext,
    StageResult,
    conclude_stage,
    stage_identity,
    upstream_results,
)
from orchestrator.pipeline.gc import folder_bytes
from orchestrator.pipeline.outputs import hash_output, output_dir, read_metrics, record_outputs
from orchestrator.pipeline.reuse import find_reusable
from orchestrator.provenance.invocation import user_at_host

#: ``progress(bytes_copied, bytes_total)`` while a source is copied.
Progress = Callable[[int, int], None]


class AdoptError(OpenlabError):
    """An adoption openlab refuses (one line saying why and what to do)."""

    exit_code = 2


def check_source(source: Path, artifacts_dir: Path) -> Path:
    """The source as an absolute folder, or a one-line refusal."""
    path = source.expanduser().resolve()
    if not path.exists():
        raise AdoptError(f"nothing to adopt at {source}: no such file or folder")
    if not path.is_dir():
        raise AdoptError(f"{source} is a file: a stage's output is a folder (put it in one and adopt that)")
    root = artifacts_dir.resolve()
    if path == root or root in path.parents:
        raise AdoptError(f"{source} is inside openlab's own outputs ({root}): run the recipe to reuse it instead")
    return path


def _copy(source: Path, target: Path, progress: Progress | None) -> None:
    """Copy a folder, reporting bytes as files are done (checkpoints are large)."""
    total = folder_bytes(source)
    done = 0

    def copy_file(src: str, dst: str) -> str:
        nonlocal done
        out = shutil.copy2(src, dst)
        done += os.path.getsize(dst)
        if progress is not None:
            progress(done, total)
        return out

    shutil.copytree(source, target, symlinks=False, copy_function=copy_file)


def adopt_stage(
    ctx: PipelineContext,
    stage: str,
    source: Path,
    *,
    move: bool = False,
    progress: Progress | None = None,
) -> StageResult:
    """Record ``source`` as the completed output of ``stage`` in the started pipeline ``ctx``.

    The stages ``stage`` reads from must already have results in ``ctx`` (reused). Raises
    :class:`AdoptError` for what openlab refuses; see the module docstring.
    """
    started = time.monotonic()
    settings, store = ctx.settings, ctx.store
    spec = ctx.pipeline.stage(stage)
    path = check_source(source, settings.artifacts_dir)
    identity = stage_identity(ctx, spec, upstream_results(ctx, spec, None))
    digest = identity.digest
    held = leases.try_hold(
        store,
        digest,
        leases.new_holder(ctx.id),
        ttl=ctx.options.lease_ttl,
        heartbeat_interval=ctx.options.heartbeat_interval,
    )
    if held is None:
        other = leases.current(store, digest)
        who = other.holder if other is not None else "another run"
        raise AdoptError(f"stage {stage} (identity {digest[:16]}) is being run by {who}: wait for it, then look again")
    out_dir = output_dir(settings, spec.name, digest)
    staging = out_dir.with_name(f".{out_dir.name}.adopt-{os.getpid()}")
    aside = out_dir.with_name(f".{out_dir.name}.replaced-{os.getpid()}")
    moved = False
    try:
        original, _ = find_reusable(store, digest, settings)
        if original is not None:
            raise AdoptError(
                f"stage {stage} of this recipe already has completed outputs (stage run {original.id}, "
                f"identity {digest[:16]}): nothing to adopt; `openlab run` reuses them"
            )
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        try:
            if move:
                path.rename(staging)  # one filesystem: instant; across filesystems, OSError below
                moved = True
            else:
                _copy(path, staging, progress)
        except OSError as exc:
            if not move:
                shutil.rmtree(staging, ignore_errors=True)
            hint = " (--move needs the source on the same filesystem as openlab's artifacts)" if move else ""
            raise AdoptError(f"could not {'move' if move else 'copy'} {source} to {out_dir}: {exc}{hint}") from None
        inputs = upstream_results(ctx, spec, None)
        replaced = live_records_at(store, out_dir)
        had_old = out_dir.exists()  # a failed run's partial output, or outputs that no longer verify
        if had_old:
            out_dir.rename(aside)
        try:
            staging.rename(out_dir)
            try:
                result = _record(ctx, spec, identity, inputs, out_dir, path, move, replaced, started)
            except BaseException:
                out_dir.rename(staging)
                raise
        except BaseException:
            if had_old:
                aside.rename(out_dir)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        return result
    except BaseException:
        if moved and staging.exists():
            staging.rename(path)  # the user's folder back where it was
        raise
    finally:
        if not move:
            shutil.rmtree(staging, ignore_errors=True)
        held.release()


def _record(
    ctx: PipelineContext,
    spec: Any,
    identity: Any,
    inputs: dict[str, StageResult],
    out_dir: Path,
    source: Path,
    move: bool,
    replaced: list[Any],
    started: float,
) -> StageResult:
    """Hash the adopted folder and record the claim in one transaction."""
    hashed = hash_output(out_dir, ctx.settings, spec.volatile)
    snap = hashed.pop("_snapshot")
    by = user_at_host()
    hashed.update(adopted_from=str(source), adopted_by=by, adopted_by_move=move)
    metrics = read_metrics(out_dir)
    now = utcnow()
    reason = f"adopted from {source} by {by}"
    with ctx.store.transaction() as tx:
        if replaced:
            mark_removed(tx, replaced, now, f"replaced by adopting {source} (pipeline run {ctx.id})")
        run = tx.add(
            StageRun(
                id=new_id(StageRun.id_prefix),
                pipeline_run_id=ctx.id,
                stage=spec.name,
                identity=identity.digest,
                identity_fields=identity.fields(),
                state="COMPLETED",
                metrics=metrics,
                started_at=now,
                ended_at=now,
            )
        )
        for key, res in inputs.items():
            art_id = res.output.get("artifact_id")
            art = tx.get(Artifact, art_id) if art_id else None
            if art is not None:
                tx.relate("used", run, art, role=key)
        outputs = record_outputs(tx, spec, run, out_dir, hashed, snap)
        run = tx.update(run, outputs=outputs)
    return conclude_stage(
        ctx, spec, identity, run.id, "COMPLETED", reason, started, out_dir=out_dir, outputs=outputs, metrics=metrics
    )


def plan_adoption(plans: list[Any], stage: str) -> None:
    """Refuse, before anything is recorded, an adoption the dry run says cannot hold."""
    for p in plans:
        if p.stage == stage:
            if p.action == "reuse":
                raise AdoptError(
                    f"stage {stage} already has completed outputs ({p.reused_from}): nothing to adopt; "
                    "`openlab run` reuses them"
                )
            if p.action == "wait":
                raise AdoptError(f"stage {stage} is being run by {p.lease_holder}: wait for it, then look again")
            return
        if p.action != "reuse":
            raise AdoptError(
                f"stage {p.stage}, which {stage} is built on, has no completed outputs here ({p.reason}): "
                f"run it first (`openlab run ... --until {p.stage}`) or adopt it"
            )
    raise ConfigError(f"stage {stage} is not a stage of this recipe")


__all__ = ["AdoptError", "adopt_stage", "check_source", "plan_adoption"]
