"""Data-parallel training stages: two tasks train the model one process would, and write once.

The processes are started the way the Slurm launcher's srun tasks are (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT; torch.distributed over gloo), here on this machine so the
workload's contract is tested without a cluster; tests/pipeline/test_tasks_slurm.py runs a stage
under srun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.prefect_server import free_port
from tests.workloads.conftest import train_cfg

REPO = Path(__file__).resolve().parents[2]


def _start_tasks(cfg: dict[str, Any], out: Path, tasks: int, stage: str = "pretrain") -> list[subprocess.Popen]:
    """``tasks`` processes of ``python -m workloads.moe STAGE``, each told its place (one: told nothing)."""
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    port = str(free_port())
    procs = []
    for rank in range(tasks):
        env = dict(os.environ)
        if tasks > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(tasks))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, "-m", "workloads.moe", stage, "--config", str(path), "--out", str(out)]
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return procs


def _run_tasks(
    cfg: dict[str, Any], out: Path, tasks: int, stage: str = "pretrain"
) -> list[subprocess.CompletedProcess]:
    done = []
    for p in _start_tasks(cfg, out, tasks, stage):
        stdout, stderr = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


def _losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train/loss"]) for r in rows]


@pytest.mark.parametrize("aux", [{}, {"aux_loss_coef": 0.5, "z_loss_coef": 0.05}], ids=["plain", "aux-losses"])
def test_two_tasks_train_the_model_one_process_trains(tiny_tokens: Path, tmp_path: Path, aux: dict) -> None:
    """Same global batch of 4 sequences: one process (2 simulated EP ranks of 2 sequences) and two
    tasks (each 1 rank of its 2 sequences) see the same token groups, so with dropless dispatch the
    averaged gradients and averaged balancing estimates give the same loss curve; with the
    auxiliary balancing and z-losses on too (their expert fractions are the global batch's). The
    routing metrics task 0 logs are the global batch's."""
    base = train_cfg(tiny_tokens, steps=8, batch_size=4)
    base["moe"] = {"dispatch": "dropless", "ranks": 2, **aux}
    single = tmp_path / "single"
    (one,) = _run_tasks(base, single, 1)
    assert one.returncode == 0, one.stderr
    split = {**base, "moe": {**base["moe"], "ranks": 1}}
    pair = tmp_path / "pair"
    results = _run_tasks(split, pair, 2)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]

    ones, twos = _losses(single), _losses(pair)
    assert [s for s, _ in twos] == list(range(1, 9)), "task 0 logged every step once; task 1 logged nothing"
    for (step, a), (_, b) in zip(ones, twos, strict=True):
        assert b == pytest.approx(a, rel=2e-4, abs=2e-5), (step, a, b)
    totals = [(r["train/total_loss"], q["train/total_loss"]) for r, q in zip(_rows(single), _rows(pair), strict=True)]
    for a, b in totals:  # the loss the optimizer minimised, auxiliary terms included
        assert b == pytest.approx(a, rel=2e-4, abs=2e-5), totals
    summary = json.loads((pair / "metrics.json").read_text())
    assert summary["tasks"] == 2 and summary["tokens_seen"] == 8 * 4 * 32, "tokens of the global batch"
    assert (pair / "checkpoint").is_dir()

    # A lab reads moe/drop_fraction and the routing histograms of a multi-task run as the whole batch's,
    # as of one process: every task's assignments are counted, and at step 1 (the same parameters in
    # both runs, before any update) the counts, entropy, balancing and z-losses are one process's.
    k = base["model"]["top_k"]
    first_one, first_two = _rows(single)[0], _rows(pair)[0]
    for row in _rows(pair):
        assert row["layer_0/routing_hist"]["num"] == 4 * 32 * k, "every task's assignments are counted"
    for key in ("routing_entropy", "load_balancing_loss", "router_z_loss", "layer_1/routing_entropy"):
        assert first_two[key] == pytest.approx(first_one[key], rel=1e-5), key
    assert first_two["layer_1/routing_hist"]["counts"] == first_one["layer_1/routing_hist"]["counts"]


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_dropping_dispatch_logs_the_drops_of_every_task(tiny_tokens: Path, tmp_path: Path) -> None:
    """With capacity drops, the logged fraction is the global batch's dropped assignments over its
    valid ones: whole drops over 4 sequences' assignments, not task 0's 2."""
    cfg = train_cfg(tiny_tokens, steps=3, batch_size=4)
    cfg["moe"] = {"dispatch": "fixed_all_to_all", "ranks": 1, "capacity_factor": 0.5}
    results = _run_tasks(cfg, tmp_path / "pair", 2)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    for row in _rows(tmp_path / "pair"):
        valid = 4 * 32 * cfg["model"]["top_k"] * cfg["model"]["n_layers"]
        dropped = row["moe/drop_fraction"] * valid
        assert dropped == pytest.approx(round(dropped), abs=1e-6) and dropped > 0, row["moe/drop_fraction"]
        assert sum(row["layer_0/routing_hist"]["counts"]) == 4 * 32 * cfg["model"]["top_k"]


def test_two_tasks_post_train_on_the_global_token_mean(tiny_tokens: Path, tmp_path: Path) -> None:
    """Post-training masks prompt tokens out of the loss, so the two tasks' halves hold different
    numbers of loss tokens; the loss (and the gradient) is still the global batch's token mean,
    so the curve is one process's."""
    pre = train_cfg(tiny_tokens, steps=2, batch_size=4)
    pre["moe"] = {"dispatch": "dropless", "ranks": 2}
    (done,) = _run_tasks(pre, tmp_path / "pre", 1)
    assert done.returncode == 0, done.stderr
    base = {**pre, "inputs": {"tokens": str(tiny_tokens), "checkpoint": str(tmp_path / "pre")}}
    base["train"] = {**pre["train"], "steps": 6}
    (one,) = _run_tasks(base, tmp_path / "single", 1, stage="posttrain")
    assert one.returncode == 0, one.stderr
    results = _run_tasks({**base, "moe": {"dispatch": "dropless", "ranks": 1}}, tmp_path / "pair", 2, "posttrain")
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    for (step, a), (_, b) in zip(_losses(tmp_path / "single"), _losses(tmp_path / "pair"), strict=True):
        assert b == pytest.approx(a, rel=2e-4, abs=2e-5), (step, a, b)


def test_a_stop_signal_to_one_task_stops_both_at_the_same_step_and_they_resume(
    tiny_tokens: Path, tmp_path: Path
) -> None:
    """SIGTERM reaches only task 1 (a scheduler signals tasks one by one): both stop at one step, task
    0 saves that step, both exit 143; run again, they resume from it and finish every step once."""
    import signal
    import time

    cfg = train_cfg(tiny_tokens, steps=400, batch_size=4)
    cfg["moe"] = {"dispatch": "dropless", "ranks": 1}
    out = tmp_path / "stopped"
    procs = _start_tasks(cfg, out, 2)
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 5:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [143, 143], [p.stderr.read()[-2000:] for p in procs if p.stderr]
    stopped_at = json.loads((out / "checkpoint" / "meta.json").read_text())["step"]
    assert stopped_at == _losses(out)[-1][0] < 400

    cfg["train"]["steps"] = stopped_at + 3
    again = _run_tasks(cfg, out, 2)
    assert [r.returncode for r in again] == [0, 0], [r.stderr[-2000:] for r in again]
    assert json.loads((out / "metrics.json").read_text())["resumed_from_step"] == stopped_at
    assert [s for s, _ in _losses(out)] == list(range(1, stopped_at + 4))


def test_a_batch_that_does_not_split_over_the_tasks_is_one_clear_error(tiny_tokens: Path, tmp_path: Path) -> None:
    cfg = train_cfg(tiny_tokens, steps=2, batch_size=6)  # 3 sequences per task: not whole EP ranks of 2
    cfg["moe"] = {"dispatch": "dropless", "ranks": 2}
    results = _run_tasks(cfg, tmp_path / "bad", 2)
    for r in results:
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "train.batch_size=6 over 2 tasks" in r.stderr and "multiple of 4" in r.stderr, r.stderr


def test_stages_that_do_not_train_refuse_several_tasks(tiny_tokens: Path, tmp_path: Path) -> None:
    cfg = {"inputs": {"corpus": str(tiny_tokens.parent / "data")}, "tokenizer": {"vocab_size": 512}}
    (first, *_) = _run_tasks(cfg, tmp_path / "tokens", 2, stage="tokenize")
    assert first.returncode == 2 and "stage tokenize runs as one task, and this job started 2" in first.stderr
