"""The workload's tracker starts W&B runs through the Links helper, with the real wandb library offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.links.wandb import find_run_dirs, read_run_dir
from workloads.moe.config import ConfigError
from workloads.moe.tracking import open_tracker


def test_tracker_run_carries_lineage_config_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    section = {"project": "replica", "config": {"openlab": {"stage_run": "sr-1"}, "seed": 7}}
    with open_tracker(tmp_path, "eval", {"seed": 0, "train": {"steps": 3}}, section) as tr:
        tr.log({"eval/loss": 2.5}, step=1)
        print("stage output a job prints")  # the launcher keeps this; W&B does not capture it
        first_id = tr.run_id
    assert first_id and (tmp_path / "wandb_run_id").read_text() == first_id
    # metrics.jsonl is the record that survives without any service
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0]) == {"step": 1, "eval/loss": 2.5}

    (run_dir,) = find_run_dirs(tmp_path, first_id)
    back = read_run_dir(run_dir)
    assert (back.run_id, back.project, back.mode) == (first_id, "replica", "offline")
    # the stage's config under the section's: lineage ids (and anything the orchestrator set) win
    assert back.config["openlab"] == {"stage_run": "sr-1"} and back.config["seed"] == 7
    assert back.config["train"] == {"steps": 3}
    assert not list(run_dir.rglob("output.log"))

    # a restarted stage (same DIR) continues the same W&B run
    with open_tracker(tmp_path, "eval", {"seed": 0}, {"project": "replica"}) as tr:
        assert tr.run_id == first_id


def test_unknown_wandb_key_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'wandb.projekt'"):
        open_tracker(tmp_path, "eval", {}, {"projekt": "x"})
    assert not (tmp_path / "wandb").exists()
