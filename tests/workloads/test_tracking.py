"""The workload's tracker starts W&B runs through the Links helper, with the real wandb library offline.

Each stage runs in its own process, as a job does (wandb keeps process-wide state), and the test reads
the run back from the files wandb wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.links.wandb import find_run_dirs, read_run_dir
from workloads.moe.config import ConfigError
from workloads.moe.tracking import open_tracker

from .conftest import train_cfg

ROOT = Path(__file__).resolve().parents[2]
STAGE = r"""
import json, sys
from workloads.moe.tracking import open_tracker
out, config, section = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
with open_tracker(__import__("pathlib").Path(out), "eval", config, section) as tr:
    tr.log({"eval/loss": 2.5}, step=1)
    print("stage output a job prints", file=sys.stderr)  # the launcher keeps this; W&B must not
    print(tr.run_id)
"""


def _stage(out: Path, config: dict, section: dict) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    proc = subprocess.run(
        [sys.executable, "-c", STAGE, str(out), json.dumps(config), json.dumps(section)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_tracker_run_carries_lineage_config_and_resumes(tmp_path: Path) -> None:
    section = {"project": "replica", "config": {"openlab": {"stage_run": "sr-1"}, "seed": 7}}
    first_id = _stage(tmp_path, {"seed": 0, "train": {"steps": 3}, "wandb": section}, section)
    assert first_id and (tmp_path / "wandb_run_id").read_text() == first_id
    # metrics.jsonl is the record that survives without any service
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0]) == {"step": 1, "eval/loss": 2.5}

    (run_dir,) = find_run_dirs(tmp_path, first_id)
    back = read_run_dir(run_dir)
    assert (back.run_id, back.project, back.mode) == (first_id, "replica", "offline")
    # the stage's config under the section's: lineage ids (and anything the orchestrator set) win
    assert back.config["openlab"] == {"stage_run": "sr-1"} and back.config["seed"] == 7
    assert back.config["train"] == {"steps": 3}
    assert "wandb" not in back.config, "the run's own settings are not a hyperparameter of it"
    assert not list(run_dir.rglob("output.log"))  # no console capture

    # a restarted stage (same DIR) continues the same W&B run
    assert _stage(tmp_path, {"seed": 0}, {"project": "replica"}) == first_id


ENDING = r"""
import sys
from pathlib import Path
from workloads.moe.tracking import open_tracker
from workloads.moe.util import Preempted
how = sys.argv[2]
with open_tracker(Path(sys.argv[1]), "pretrain", {}, {"project": "replica"}) as tr:
    tr.log({"train/loss": 2.5}, step=1)
    if how == "raises":
        raise ValueError("lr must be positive")
    if how == "preempted":
        raise Preempted(15, 1)
"""


@pytest.mark.parametrize(("how", "state"), [("ends", "finished"), ("raises", "failed"), ("preempted", "preempted")])
def test_the_wandb_run_ends_as_the_stage_did(tmp_path: Path, how: str, state: str) -> None:
    """A stage that crashed was a *finished* run in W&B, beside its successful ones; now W&B is told
    it failed, or that a scheduler stopped it (preempting) when the stage saved a checkpoint and
    stopped on a signal, as read back from the run's own files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    proc = subprocess.run(
        [sys.executable, "-c", ENDING, str(tmp_path), how], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == (0 if how == "ends" else 1), proc.stderr
    (run_dir,) = find_run_dirs(tmp_path)
    assert read_run_dir(run_dir, reader="protobuf").state == state, (how, proc.stderr[-2000:])


def test_unknown_wandb_key_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'wandb.projekt'"):
        open_tracker(tmp_path, "eval", {}, {"projekt": "x"})
    assert not (tmp_path / "wandb").exists()


WITHOUT_WANDB = r"""
import runpy, sys
sys.modules["wandb"] = None  # this Python has no wandb (as on an accelerator image with its own packages)
sys.argv = ["workloads.moe", *sys.argv[1:]]
runpy.run_module("workloads.moe", run_name="__main__")
"""


def test_a_wandb_section_without_the_library_is_one_line_not_a_traceback(tmp_path: Path, tiny_tokens: Path) -> None:
    """On a machine whose Python lacks wandb, a stage asked to log to W&B stops before its first step with
    one line saying what to do (install it, or drop the section), and writes no checkpoint or metrics."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({**train_cfg(tiny_tokens), "wandb": {"project": "p"}}))
    out = tmp_path / "pretrain"
    argv = ["pretrain", "--config", str(cfg), "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_WANDB, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: the config has a wandb: section but the wandb library is not installed")
    assert "--set wandb=null" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not (out / "checkpoint").exists() and not (out / "metrics.jsonl").exists()
    # The way out the message names works in that same Python.
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_WANDB, *argv, "--set", "wandb=null"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "checkpoint").is_dir() and (out / "metrics.jsonl").is_file()
