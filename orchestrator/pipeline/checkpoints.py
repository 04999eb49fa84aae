"""A stage that checkpoints, against its time limit: when to warn it, and whether it saved.

A training stage longer than a cluster's wall-time cap is not a failure if each job gets further:
it is warned ahead of its limit (:func:`warn_before_limit`, SIGUSR1) so that it saves and stops,
and a job stopped by the limit itself that saved its checkpoint anew (:func:`stopped_with_progress`)
made progress the next attempt resumes from. :mod:`orchestrator.pipeline.execute` then runs the
stage again as after a preemption; such a stop does not count towards ``[pipeline]
preemption_retries``, which bounds the stops in a row that saved nothing. The checkpoint is the
file :attr:`~orchestrator.pipeline.dag.StageSpec.checkpoint` names in the stage's output folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.launchers.base import TIME_LIMIT_REASON, JobState

if TYPE_CHECKING:
    from orchestrator.launchers.base import JobStatus
    from orchestrator.pipeline.dag import StageSpec


#: The most seconds ahead of its time limit a checkpointing stage is warned (submitit's default is
#: 90 s; a large model's checkpoint takes minutes to write, and Slurm may signal up to 60 s early).
WARN_BEFORE_LIMIT_MAX = 300


def warn_before_limit(spec: StageSpec) -> int | None:
    """How long before its time limit a stage that checkpoints is sent SIGUSR1 to save and stop: the
    recipe's ``warn_before_limit`` (0: none), else a tenth of the limit, at most
    :data:`WARN_BEFORE_LIMIT_MAX`. Stopped at the limit itself, it has only the scheduler's grace
    (Slurm's KillWait, 30 s by default) to finish a step and save, and what it cannot save is
    computed again; warned, the next attempt goes on from where it was."""
    if not spec.checkpoint or not spec.time_limit:
        return None
    if spec.warn_before_limit is not None:  # the recipe's, checked to be under the limit
        return spec.warn_before_limit or None
    if spec.time_limit < 2:
        return None
    return max(1, min(WARN_BEFORE_LIMIT_MAX, spec.time_limit // 10))


def checkpoint_mark(out_dir: Path, spec: StageSpec) -> tuple[int, int, int] | None:
    """What tells one save of the stage's checkpoint from the next: its inode, modification time and
    size (a save replaces the file). Compared before and after a job, not against a clock, so a
    node whose clock differs from this machine's cannot fake progress or hide it."""
    if not spec.checkpoint:
        return None
    try:
        st = (out_dir / spec.checkpoint).stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def stopped_with_progress(
    status: JobStatus, before: tuple[int, int, int] | None, after: tuple[int, int, int] | None
) -> bool:
    """Whether a job its own time limit stopped saved its checkpoint anew on the way: the next attempt
    resumes from there and gets further, so it is not the failure a time limit is for a stage that
    starts over (which would be stopped at the same point again)."""
    timed_out = status.state is JobState.FAILED and (status.reason or "").startswith(TIME_LIMIT_REASON)
    return timed_out and after is not None and after != before
