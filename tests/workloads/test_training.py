"""Training behaviour: loss falls, resume is exact, bad configs fail before compute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workloads.moe.__main__ import main
from workloads.moe.config import parse_config
from workloads.moe.train import run_train

from .conftest import train_cfg


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return {r["step"]: r["train/loss"] for r in rows}


def test_tiny_training_loss_falls(tiny_tokens: Path, tmp_path: Path) -> None:
    cfg = parse_config(train_cfg(tiny_tokens, steps=30, lr=0.01))
    res = run_train(cfg, tmp_path, "pretrain")
    losses = _losses(tmp_path)
    first = sum(losses[s] for s in (1, 2, 3)) / 3
    last = sum(losses[s] for s in (28, 29, 30)) / 3
    assert last < first - 0.5, (first, last)
    assert res["tokens_seen"] == 30 * 4 * 32
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    for key in (
        "moe/drop_fraction",
        "moe/sender_drop_fraction",
        "moe/receiver_drop_fraction",
        "train/router/capacity_overflow_rate_mean",
        "routing_entropy",
        "layer_1/routing_hist",
    ):
        assert key in row


def test_resume_gives_the_same_next_step_loss(tiny_tokens: Path, tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    run_train(parse_config(train_cfg(tiny_tokens, steps=6)), straight, "pretrain")
    resumed = tmp_path / "resumed"
    first = run_train(parse_config(train_cfg(tiny_tokens, steps=6, stop_after=3)), resumed, "pretrain")
    assert first["stopped_after"] == 3
    assert max(_losses(resumed)) == 3
    second = run_train(parse_config(train_cfg(tiny_tokens, steps=6)), resumed, "pretrain")
    assert second["resumed_from_step"] == 3
    a, b = _losses(straight), _losses(resumed)
    assert sorted(b) == [1, 2, 3, 4, 5, 6]  # no duplicated or missing steps in metrics.jsonl
    for step in (4, 5, 6):
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])


def test_keep_every_keeps_each_revision_as_it_was_and_a_resume_leaves_them_so(
    tiny_tokens: Path, tmp_path: Path
) -> None:
    """Marin #8949: immutable per-step checkpoint revisions with tokens seen. Every keep_every-th
    step's checkpoint stays, byte for byte, after later saves and a preempted-and-resumed run; each
    loads as the step it names, and the index lists them with their token counts."""
    import hashlib

    from workloads.moe.train import load_state

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    out = tmp_path / "out"
    run_train(
        parse_config(train_cfg(tiny_tokens, steps=6, checkpoint_every=6, keep_every=2, stop_after=3)), out, "pretrain"
    )
    revisions = out / "checkpoint" / "revisions"
    assert sorted(p.name for p in revisions.iterdir()) == ["step-000002.pt"]
    before = digest(revisions / "step-000002.pt")
    res = run_train(parse_config(train_cfg(tiny_tokens, steps=6, checkpoint_every=6, keep_every=2)), out, "pretrain")
    assert res["resumed_from_step"] == 3 and res["checkpoint_revisions"] == 3
    assert sorted(p.name for p in revisions.iterdir()) == ["step-000002.pt", "step-000004.pt", "step-000006.pt"]
    assert digest(revisions / "step-000002.pt") == before  # not rewritten by the saves after it
    index = json.loads((out / "checkpoint" / "revisions.json").read_text())
    assert [(r["step"], r["tokens_seen"], r["file"]) for r in index] == [
        (s, s * 4 * 32, f"revisions/step-{s:06d}.pt") for s in (2, 4, 6)
    ]
    for row in index:
        state = load_state(out / "checkpoint" / row["file"])
        assert (state["step"], state["tokens_seen"]) == (row["step"], row["tokens_seen"])
    assert digest(revisions / "step-000006.pt") == digest(out / "checkpoint" / "state.pt")  # the last is the latest

    # stopped between a save and its revision (simulated: the revision removed): the resume makes it
    again = tmp_path / "again"
    run_train(parse_config(train_cfg(tiny_tokens, steps=4, keep_every=2, stop_after=2)), again, "pretrain")
    (again / "checkpoint" / "revisions" / "step-000002.pt").unlink()
    (again / "checkpoint" / "revisions.json").unlink()
    run_train(parse_config(train_cfg(tiny_tokens, steps=4, keep_every=2)), again, "pretrain")
    listed = json.loads((again / "checkpoint" / "revisions.json").read_text())
    assert [r["step"] for r in listed] == [2, 4] and load_state(again / "checkpoint" / listed[0]["file"])["step"] == 2


def _write(tmp_path: Path, cfg: dict) -> str:
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps(cfg))
    return str(p)


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"moe": {"dispatch": "ring_magic"}}, "unknown dispatch 'ring_magic'"),
        ({"model": {"top_k": 4, "n_experts": 4}}, "model.top_k=4 must be < model.n_experts=4"),
        ({"model": {"n_experts": 6}, "moe": {"ranks": 4}}, "n_experts=6 is not divisible by moe.ranks=4"),
        ({"model": {"context": 10_000_000}}, "context=10000000 is longer than the data"),
        ({"model": {"n_expert": 4}}, "unknown key 'model.n_expert' (did you mean 'n_experts'? known: "),
        ({"moe": {"dispatch": "water_filling"}}, "unknown dispatch 'water_filling' (did you mean 'waterfilling'?"),
        ({"train": {"steps": "ten"}}, "'train.steps' must be an integer"),
        ({"moe": {"qb_estimator": "median"}}, "moe.qb_estimator 'median' is not one of topk, hist"),
        ({"train": {"keep_every": -1}}, "train.keep_every must be >= 0"),
        # values that trained on wrongly or crashed in torch, numpy or the dispatch, after the data loaded
        ({"train": {"lr": float("nan")}}, "'train.lr' must be a finite number, got nan"),
        ({"train": {"lr": -0.001}}, "train.lr must be >= 0"),  # adam's ValueError, after the model was built
        ({"train": {"grad_clip": -1.0}}, "train.grad_clip must be >= 0 (0: no clipping)"),  # flipped gradients
        ({"train": {"min_lr_ratio": -3.0}}, "train.min_lr_ratio must be in [0, 1]"),  # a negative learning rate
        ({"moe": {"capacity_factor": 1e300}}, "moe: capacity factors must be > 0 and at most 1000"),
        ({"moe": {"ranks": 0}}, "moe.ranks must be >= 1, got 0"),
        ({"eval": {"batches": 0}}, "eval.batches must be >= 1"),
        ({"seed": -1}, "seed must be >= 0, got -1"),
        ({"data": {"domains": {"../../escaped": "stdlib:code"}}}, "'../../escaped' is no name for a domain"),
    ],
)
def test_bad_config_one_line_error_before_compute(
    tiny_tokens: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], patch: dict, needle: str
) -> None:
    cfg = train_cfg(tiny_tokens)
    for section, values in patch.items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    out = tmp_path / "out"
    rc = main(["pretrain", "--config", _write(tmp_path, cfg), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
    assert not (out / "checkpoint").exists() and not (out / "metrics.jsonl").exists()


def test_cuda_asked_for_where_there_is_none_is_one_line_before_compute(
    tiny_tokens: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`device: cuda` on a machine without a GPU was torch's AssertionError after the model was built."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: device cuda is what it runs on")
    out = tmp_path / "out"
    rc = main(
        ["pretrain", "--config", _write(tmp_path, {**train_cfg(tiny_tokens), "device": "cuda"}), "--out", str(out)]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "device is cuda, and this machine has no CUDA GPU" in err, err
    assert not (out / "checkpoint").exists() and not (out / "metrics.jsonl").exists()


def test_same_config_and_threads_give_bitwise_identical_runs(tiny_tokens: Path, tmp_path: Path) -> None:
    """Two runs of one config on the same thread count give the same losses to the last bit, as
    separate processes (how stages run). Without deterministic kernels, multithreaded CPU scatter-adds
    (the MoE combine and its backward) made two 2-thread runs differ from step 2, and the QB
    fixed-point iteration carried that into every drop figure: a rerun could not confirm a result."""
    cfg = train_cfg(tiny_tokens, steps=8, batch_size=16)
    cfg["threads"] = 2
    cfg["model"].update({"d_model": 64, "n_heads": 4, "context": 128, "n_experts": 24, "top_k": 4})
    cfg["moe"]["ranks"] = 4
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        done = subprocess.run(
            [sys.executable, "-m", "workloads.moe", "pretrain", "--config", str(path), "--out", str(out)],
            capture_output=True,
            text=True,
            env={**os.environ, "WANDB_MODE": "disabled"},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(_losses(out))
    assert runs[0] == runs[1]
    # and the same checkpoint, byte for byte: the stages after it hash it, and a forced re-run that wrote
    # other bytes (Python's generator state from the OS's entropy) made every one of them run again
    saved = [(tmp_path / name / "checkpoint" / "state.pt").read_bytes() for name in ("a", "b")]
    assert saved[0] == saved[1]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_saves_the_step_and_a_rerun_finishes_as_if_uninterrupted(
    tiny_tokens: Path, tmp_path: Path, signame: str
) -> None:
    """What a scheduler does to a long run (Slurm's time limit or its --signal warning, preemption, an
    eviction): the stage finishes its step, saves it, exits 128+signal, and the rerun resumes there."""
    import signal
    import time

    steps = 150  # signalled at step 5 or so: the rest (seconds) is the margin for the signal to land
    cfg = _write(tmp_path, train_cfg(tiny_tokens, steps=steps))
    straight = tmp_path / "straight"
    run_train(parse_config(train_cfg(tiny_tokens, steps=steps)), straight, "pretrain")
    out = tmp_path / "stopped"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "workloads.moe", "pretrain", "--config", cfg, "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(_losses(out)) < 5 if (out / "metrics.jsonl").exists() else True:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be stopped"
        time.sleep(0.05)
    proc.send_signal(getattr(signal, signame))
    _, stderr = proc.communicate(timeout=60)
    signum = getattr(signal, signame)
    assert proc.returncode == 128 + signum, stderr
    done = max(_losses(out))
    assert 5 <= done < steps, done
    assert f"stopped by {signame} after step {done}; checkpoint saved" in stderr
    rerun = subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert json.loads(rerun.stdout.strip().splitlines()[-1])["resumed_from_step"] == done
    a, b = _losses(straight), _losses(out)
    assert sorted(b) == list(range(1, steps + 1))
    assert abs(a[steps] - b[steps]) <= 1e-6, (a[steps], b[steps])


def test_the_workload_stops_on_the_signals_the_orchestrator_reads_as_preemption() -> None:
    """The workload exits 128+signal on these; the launchers read exactly those exits as PREEMPTED."""
    from orchestrator.launchers.base import STOP_SIGNALS
    from workloads.moe.util import StopSignals

    assert StopSignals.SIGNALS == STOP_SIGNALS


def test_the_recipes_ask_for_tasks_only_where_the_workload_trains_over_them() -> None:
    """Recipes refuse `tasks_per_node` on a stage the workload would refuse to run as several tasks:
    the one list, stated twice because the workload imports nothing of the orchestrator."""
    from orchestrator.recipes import TRAINING_STAGES
    from workloads.moe.__main__ import TRAINING_STAGES as WORKLOAD_TRAINING_STAGES

    assert TRAINING_STAGES == WORKLOAD_TRAINING_STAGES


def test_the_pipeline_knows_where_each_training_stage_saves_the_progress_it_resumes_from() -> None:
    """A stage stopped by its time limit goes on only if its checkpoint was saved anew: the pipeline
    looks for the file the workload writes and resumes from, stated twice because the workload
    imports nothing of the orchestrator. A wrong name would fail every long training at its limit."""
    from orchestrator.pipeline.dag import MOE_CHECKPOINT, moe_pipeline
    from workloads.moe.train import CKPT

    assert MOE_CHECKPOINT == CKPT
    stages = ("data", "tokenize", "pretrain", "midtrain", "posttrain", "eval", "repro")
    saving = {s.name for s in moe_pipeline(stages=stages).stages if s.checkpoint}
    assert saving == {"pretrain", "midtrain", "posttrain", "repro"}
