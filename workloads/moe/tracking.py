"""The one seam between the workload and experiment tracking.

`open_tracker` is the only function stages call. It always appends every logged step as a JSON line to
DIR/metrics.jsonl (the record that survives without any service), and mirrors it to Weights & Biases
when the stage config has a `wandb:` section: mode comes from the environment (offline when
WANDB_API_KEY is unset or WANDB_MODE=offline, else online), and run id/project/entity/group/job_type/
tags/config/resume come from that section. Without a section W&B is disabled. The links engineer can
swap the body of `_wandb_run` for their helper without touching any stage.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

_WANDB_KEYS = ("id", "project", "entity", "group", "job_type", "tags", "config", "resume", "name", "notes")


class Tracker:
    """Appends metrics to metrics.jsonl and (optionally) a W&B run. Use as a context manager."""

    def __init__(self, out: Path, run: Any | None) -> None:
        self.path = out / "metrics.jsonl"
        self.run = run
        self.run_id: str | None = getattr(run, "id", None)
        out.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._fh.write(json.dumps({"step": step, **metrics}) + "\n")
        self._fh.flush()
        if self.run is not None:
            self.run.log(_to_wandb(metrics), step=step)

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            for k, v in values.items():
                if isinstance(v, int | float | str):
                    self.run.summary[k] = v

    def close(self) -> None:
        self._fh.close()
        if self.run is not None:
            self.run.finish()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    import wandb

    unknown = set(section) - set(_WANDB_KEYS)
    if unknown:
        from .config import ConfigError

        raise ConfigError(f"config: unknown key 'wandb.{sorted(unknown)[0]}' (known: {', '.join(_WANDB_KEYS)})")
    offline = not os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") == "offline"
    id_file = out / "wandb_run_id"
    run_id = section.get("id") or (id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4))
    id_file.write_text(run_id)  # a restarted stage resumes the same run
    return wandb.init(
        id=run_id,
        project=section.get("project", "openlab-moe"),
        entity=section.get("entity"),
        group=section.get("group"),
        job_type=section.get("job_type", stage),
        tags=section.get("tags"),
        name=section.get("name"),
        notes=section.get("notes"),
        config={**config, **(section.get("config") or {})},
        resume=section.get("resume", "allow"),
        mode="offline" if offline else "online",
        dir=str(out),
        settings=wandb.Settings(console="off", silent=True),
    )


def open_tracker(out: Path, stage: str, config: dict[str, Any], section: dict[str, Any] | None) -> Tracker:
    """Start tracking a stage run; `section` is the config's `wandb:` mapping (None = W&B disabled)."""
    run = _wandb_run(section, out, stage, config) if section is not None else None
    return Tracker(out, run)
