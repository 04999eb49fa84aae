"""The one seam between the workload and experiment tracking.

`open_tracker` is the only function stages call. It always appends every logged step as a JSON line to
DIR/metrics.jsonl (the record that survives without any service), and mirrors it to Weights & Biases
when the stage config has a `wandb:` section: mode comes from the environment (WANDB_MODE where set,
else online where a key is at hand, WANDB_API_KEY or `wandb login`'s netrc, else offline), and run
id/project/entity/group/job_type/tags/config/resume come from that section, through the Links helper
`orchestrator.links.wandb_init`. Without a section W&B is disabled.

Given the stage's step count, it also prints a progress line to stderr (step, loss, drop fraction,
time per step, time left) at the first step, at most every PROGRESS_EVERY_S after, and at the last:
a 20-minute `repro` is otherwise silent, and stderr is what a launcher streams into the Prefect logs.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

PROGRESS_EVERY_S = 10.0


class Tracker:
    """Appends metrics to metrics.jsonl and (optionally) a W&B run, and reports progress on stderr when
    it knows the step count. Use as a context manager."""

    def __init__(self, out: Path, run: Any | None, total_steps: int | None = None) -> None:
        self.path = out / "metrics.jsonl"
        self.run = run
        self.run_id: str | None = getattr(run, "id", None)
        self.total_steps = total_steps
        self._started = time.monotonic()
        self._first_step: int | None = None  # the step this process started at (a resumed stage starts late)
        self._printed_at: float | None = None
        out.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._fh.write(json.dumps({"step": step, **metrics}) + "\n")
        self._fh.flush()
        if self.run is not None:
            self.run.log(_to_wandb(metrics), step=step)
        if self.total_steps:
            self._progress(metrics, step, self.total_steps)

    def _progress(self, metrics: dict[str, Any], step: int, total: int) -> None:
        now = time.monotonic()
        if self._first_step is None:
            self._first_step = step - 1
        last = step >= total
        if self._printed_at is not None and now - self._printed_at < PROGRESS_EVERY_S and not last:
            return
        self._printed_at = now
        per_step = (now - self._started) / max(1, step - self._first_step)
        parts = [f"step {step}/{total} ({100 * step // total}%)"]  # no stage name: the pipeline's log prefixes it
        for key, label, fmt in (("train/loss", "loss", "{:.4f}"), ("moe/drop_fraction", "drop", "{:.2%}")):
            if isinstance(metrics.get(key), int | float):
                parts.append(f"{label} {fmt.format(metrics[key])}")
        parts.append(f"{per_step:.2f} s/step")
        parts.append("done" if last else f"about {_duration(per_step * (total - step))} left")
        print(" | ".join(parts), file=sys.stderr, flush=True)

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            for k, v in values.items():
                if isinstance(v, int | float | str):
                    self.run.summary[k] = v

    def close(self, exit_code: int = 0) -> None:
        self._fh.close()
        if self.run is not None:
            self.run.finish(exit_code=exit_code)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """Finish the W&B run as the stage ended: a stage that raised is a failed run in W&B, not a
        finished one, and one stopped by a scheduler's signal (:class:`~workloads.moe.util.Preempted`)
        is marked preempting first, so W&B shows it stopped from outside, to be resumed."""
        from .util import Preempted

        if exc is None:
            self.close()
            return
        if isinstance(exc, Preempted) and self.run is not None:
            try:
                self.run.mark_preempting()
            except Exception:  # noqa: BLE001 - the state is a courtesy; finishing the run is not
                pass
        self.close(exit_code=exc.exit_code if isinstance(exc, Preempted) else 1)


class SilentTracker:
    """The tracker of every task but task 0 of a multi-task stage: task 0 writes metrics.jsonl and
    the W&B run, once; the others log nothing (and print no progress twice)."""

    run_id: str | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def summary(self, values: dict[str, Any]) -> None:
        pass

    def __enter__(self) -> SilentTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _to_wandb(metrics: dict[str, Any]) -> dict[str, Any]:
    import wandb

    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, dict) and "counts" in v:  # routing histogram: unit buckets [e, e+1)
            counts = v["counts"]
            out[k] = wandb.Histogram(np_histogram=(counts, list(range(len(counts) + 1))))
        elif isinstance(v, int | float):
            out[k] = v
    return out


def _wandb_run(section: dict[str, Any], out: Path, stage: str, config: dict[str, Any]) -> Any:
    """Start the stage's W&B run through the Links helper (`orchestrator.links.wandb_init`, which
    imports only the standard library and wandb): the same keys, mode rule and lineage config merge
    as every other openlab job. Here only the defaults a bare config needs are added: a project, the
    stage as job type, and a run id kept in DIR/wandb_run_id so a restarted stage resumes its run."""
    import importlib.util

    from orchestrator.links.wandb_init import SECTION_KEYS, init_run

    if importlib.util.find_spec("wandb") is None:  # e.g. a GPU box's own Python image, without wandb
        from .config import WorkloadError

        raise WorkloadError(
            "the config has a wandb: section but the wandb library is not installed in this Python; "
            "install it (pip install wandb) or run without W&B (--set wandb=null); metrics.jsonl is kept either way"
        )
    unknown = set(section) - set(SECTION_KEYS)
    if unknown:
        from .config import ConfigError, known_names

        first = sorted(unknown)[0]
        raise ConfigError(f"config: unknown key 'wandb.{first}' {known_names(first, SECTION_KEYS)}")
    id_file = out / "wandb_run_id"
    run_id = section.get("id") or (id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4))
    id_file.write_text(run_id)  # a restarted stage resumes the same run
    config = {k: v for k, v in config.items() if k != "wandb"}  # the run's own settings: not a hyperparameter
    return init_run({"project": "openlab-moe", "job_type": stage, **section, "id": run_id}, dir=out, config=config)


def open_tracker(
    out: Path, stage: str, config: dict[str, Any], section: dict[str, Any] | None, total_steps: int | None = None
) -> Tracker:
    """Start tracking a stage run; `section` is the config's `wandb:` mapping (None = W&B disabled);
    `total_steps`, for a training loop, turns on the progress lines."""
    run = _wandb_run(section, out, stage, config) if section is not None else None
    return Tracker(out, run, total_steps)
