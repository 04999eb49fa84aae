"""The reproduction stage: capacity scaling arithmetic and a short run producing the table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from workloads.moe.config import ArmConfig, ConfigError, ModelConfig, WorkloadError, parse_config, validate
from workloads.moe.dispatch import DispatchSpec
from workloads.moe.model import MoELM, RoutingRuntime
from workloads.moe.repro import arm_spec, demand_cv, demand_units, median_stderr, our_mu, run_repro, scaled
from workloads.moe.train import TokenData

from .conftest import TINY_MODEL


def test_scaling_keeps_z() -> None:
    # fixed cell: mu = 2048 -> 512 halves sqrt: (1.0625 - 1) * sqrt(2048/512) = 0.125
    assert math.isclose(scaled(1.0625, 2048, 512), 1.125)
    assert scaled(1.0, 2048, 7) == 1.0  # cf 1.0 has z = 0 at any mu
    mu = our_mu("pooled_wave", P=4, E=24, K=4, T=2048, W=3, chunks=2)
    assert math.isclose(mu["sender"], 8192 / 12) and math.isclose(mu["receiver"], 4 * 8192 / 72)
    spec, info = arm_spec(ArmConfig("pw", "pooled_wave", 1.33, 1.05, 3, 2), 4, 24, 4, 2048, True)
    assert math.isclose((spec.transport_capacity_factor - 1) * math.sqrt(mu["sender"]), 0.05 * math.sqrt(2731))
    assert math.isclose((spec.capacity_factor - 1) * math.sqrt(mu["receiver"]), 0.33 * math.sqrt(29127))
    raw, _ = arm_spec(ArmConfig("pw", "pooled_wave", 1.33, 1.05, 3, 2, scale=False), 4, 24, 4, 2048, True)
    assert (raw.capacity_factor, raw.transport_capacity_factor) == (1.33, 1.05)
    # a factor under 1 at a smaller replica has no positive equivalent: it ran at cf' < 0, dropped every
    # assignment, and the table showed that as measured; refused in one line, the unscaled arm still runs
    with pytest.raises(ConfigError, match=r"repro arm 'tight': capacity factor 0.9 scales to -"):
        arm_spec(ArmConfig("tight", "waterfilling", 0.9, 1.0, 1, 2), 4, 24, 4, 64, True)  # a tiny replica's T
    unscaled, _ = arm_spec(ArmConfig("tight", "waterfilling", 0.9, 1.0, 1, 2, scale=False), 4, 24, 4, 64, True)
    assert unscaled.capacity_factor == 0.9


def test_short_repro_run_reports_every_arm(tiny_tokens: Path, tmp_path: Path) -> None:
    arms = [
        {"name": "fixed1", "dispatch": "fixed_all_to_all", "capacity_factor": 1.0, "marin_drop": 0.0741},
        {"name": "pw", "dispatch": "pooled_wave", "capacity_factor": 1.33, "transport_capacity_factor": 1.05},
        {"name": "ragged", "dispatch": "ragged", "capacity_factor": 1.15},
        {"name": "wf", "dispatch": "waterfilling", "capacity_factor": 1.05},
    ]
    cfg = parse_config(
        {
            "threads": 1,
            "inputs": {"tokens": str(tiny_tokens)},
            "model": {**TINY_MODEL, "n_experts": 8},
            "moe": {"ranks": 2},
            "train": {"steps": 4, "batch_size": 4, "checkpoint_every": 2},
            "repro": {"train_arm": "pw", "late_window": 2, "arms": arms},
        }
    )
    res = run_repro(cfg, tmp_path)
    assert [r["arm"] for r in res["table"]] == ["fixed1", "pw", "ragged", "wf"]
    assert [r["in_training_forward"] for r in res["table"]] == [False, True, False, False]
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    late = sorted(r["repro/fixed1/moe/drop_fraction"] for r in rows[-2:])
    assert math.isclose(res["table"][0]["median_drop"], sum(late) / 2)
    assert "| fixed1 |" in (tmp_path / "repro_table.md").read_text()
    # The headline each arm reports (what lineage records and the nightly verdict compares) carries
    # the median's standard error, which the verdict scales its tolerance by.
    for row in res["table"]:
        assert res["repro"][row["arm"]] == {
            "late_median_drop": row["median_drop"],
            "late_median_drop_se": row["median_drop_se"],
        }
        assert row["median_drop_se"] >= 0.0


def test_median_stderr_matches_the_textbook_value_for_independent_draws() -> None:
    """For independent normal draws the median's standard error is sqrt(pi/2) * sigma / sqrt(n); the
    block bootstrap must land near it (it is what sizes the nightly's tolerance), shrink as the window
    grows, be zero for a constant series and depend on the values alone."""
    rng = np.random.default_rng(1)
    sigma, n = 0.02, 30
    textbook = math.sqrt(math.pi / 2) * sigma / math.sqrt(n)
    estimates = [median_stderr(list(rng.normal(0.03, sigma, n))) for _ in range(40)]
    assert 0.75 * textbook < float(np.median(estimates)) < 1.25 * textbook, (estimates, textbook)
    long = [median_stderr(list(rng.normal(0.03, sigma, 480))) for _ in range(10)]
    assert float(np.median(long)) < 0.4 * float(np.median(estimates))  # 16x the steps: about a quarter
    assert median_stderr([0.01] * 30) == 0.0 and median_stderr([0.5]) == 0.0
    values = list(rng.normal(0.03, sigma, n))
    assert median_stderr(values) == median_stderr(list(values))


def test_demand_units_hand_computed() -> None:
    # P=2, E=4 (E_l=2), K=1, T=4: A=4. Rank 0 routes to experts 0,0,1,2; rank 1 to 3,3,3,0.
    ex = torch.tensor([0, 0, 1, 2, 3, 3, 3, 0]).view(-1, 1)
    u = demand_units(ex, P=2, E=4, chunks=2)
    assert u["cell"][0].tolist() == [2, 1, 1, 0, 1, 0, 0, 3] and u["cell"][1] == 1.0  # A/E
    assert u["pool"][0].tolist() == [3, 1, 1, 3] and u["pool"][1] == 2.0  # A/P
    assert u["expert"][0].tolist() == [3, 1, 1, 3] and u["expert"][1] == 2.0  # P*A/E
    assert u["chunk"][0].tolist() == [3, 1, 1, 3] and u["chunk"][1] == 2.0  # A/chunks
    assert u["group"][0].tolist() == [4, 4] and u["group"][1] == 4.0  # A
    cv = demand_cv([ex], P=2, E=4, chunks=2)
    # cell: (n/mu - 1)^2 = 1,0,0,1,0,1,1,4 -> mean 1; pool: 0.25 each; group: 0.
    assert math.isclose(cv["cell/cv"], 1.0) and math.isclose(cv["pool/cv"], 0.5) and cv["group/cv"] == 0.0
    assert math.isclose(cv["group/poisson_cv"], 0.5)


def test_distinct_batch_windows_never_overlap() -> None:
    data = TokenData.__new__(TokenData)
    data.shards = {("a", "train"): np.arange(1000), ("b", "train"): np.arange(5000, 5300)}
    x = data.distinct_batch(np.random.default_rng(0), 9, 32, {"a": 0.5, "b": 0.5}, "train")
    assert x.shape == (9, 32)
    assert all(bool((row[1:] - row[:-1] == 1).all()) for row in x)  # contiguous windows
    assert len(set(x.reshape(-1).tolist())) == 9 * 32  # no token shared by two sequences
    with pytest.raises(WorkloadError, match="distinct windows"):
        data.distinct_batch(np.random.default_rng(0), 12, 32, {"b": 1.0}, "train")  # b holds 9 windows


def test_route_records_the_same_routing_as_forward(tiny_tokens: Path) -> None:
    mc = ModelConfig(**{**TINY_MODEL, "vocab_size": 512, "n_layers": 3})
    torch.manual_seed(0)
    model = MoELM(mc).train()
    rt = RoutingRuntime(DispatchSpec("pooled_wave", 2, 4, 1.0, 1.0), record_routing=True)
    x = torch.randint(0, 512, (4, 32))
    with torch.no_grad():
        model(x, x, rt)
        fwd = [(m.last_experts.clone(), m.qb_pending.clone(), m.last_stats) for m in model.moe_layers()]
        model.route(x, rt)
        for m, (ex, beta, st) in zip(model.moe_layers(), fwd, strict=True):
            assert torch.equal(m.last_experts, ex) and torch.equal(m.qb_pending, beta)
            assert (m.last_stats.counts, m.last_stats.sender_dropped) == (st.counts, st.sender_dropped)


def test_separate_measurement_batch(tiny_tokens: Path, tmp_path: Path) -> None:
    arms = [
        {"name": "pw", "dispatch": "pooled_wave", "capacity_factor": 1.0, "transport_capacity_factor": 1.0},
        {"name": "fixed1", "dispatch": "fixed_all_to_all", "capacity_factor": 1.0},
    ]
    base = {
        "threads": 1,
        "inputs": {"tokens": str(tiny_tokens)},
        "model": {**TINY_MODEL, "n_experts": 8},
        "moe": {"ranks": 2},
        "train": {"steps": 5, "batch_size": 2, "checkpoint_every": 5},
        "repro": {"train_arm": "pw", "late_window": 2, "measure_batch_size": 6, "arms": arms},
    }
    res = run_repro(parse_config(base), tmp_path)
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # Measured: the window (steps 4, 5) and the step before it (QB bias from a measurement batch).
    assert [("repro/pw/moe/drop_fraction" in r) for r in rows] == [False, False, True, True, True]
    for r in rows[2:]:  # the measurement pass ran the train arm: its own stats equal the arm's
        assert math.isclose(r["repro/measure/moe/drop_fraction"], r["repro/pw/moe/drop_fraction"])
    assert (res["sequences_per_rank"], res["tokens_per_rank"], res["train_batch_size"]) == (3, 3 * 32, 2)
    assert set(res["demand"]) == {"cell", "pool", "expert", "chunk", "group"}
    with pytest.raises(ConfigError, match="measure_batch_size=5 must be 0 or a positive multiple"):
        validate(parse_config({**base, "repro": {**base["repro"], "measure_batch_size": 5}}), "repro")


def test_early_window_measured_like_the_late_one(tiny_tokens: Path, tmp_path: Path) -> None:
    arms = [
        {"name": "pw", "dispatch": "pooled_wave", "capacity_factor": 1.0, "transport_capacity_factor": 1.0},
        {"name": "wf", "dispatch": "waterfilling", "capacity_factor": 1.0, "marin_early_drop": 0.0074},
    ]
    base = {
        "threads": 1,
        "inputs": {"tokens": str(tiny_tokens)},
        "model": {**TINY_MODEL, "n_experts": 8},
        "moe": {"ranks": 2},
        "train": {"steps": 8, "batch_size": 2, "checkpoint_every": 8},
        "repro": {"train_arm": "pw", "late_window": 2, "measure_batch_size": 6, "early_steps": [3], "arms": arms},
    }
    res = run_repro(parse_config(base), tmp_path)
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # Measured: early step 3 and the step before it (2, unreported), the late window (7, 8) and step 6.
    measured = [r["step"] for r in rows if "repro/pw/moe/drop_fraction" in r]
    assert measured == [2, 3, 6, 7, 8]
    assert res["early_steps"] == [3]
    wf = res["table"][1]
    assert wf["early_median_drop"] == rows[2]["repro/wf/moe/drop_fraction"]
    assert wf["marin_early_drop"] == 0.0074 and res["table"][0]["marin_early_drop"] is None
    assert "Early window" in (tmp_path / "repro_table.md").read_text()
    with pytest.raises(ConfigError, match="early_steps"):
        validate(parse_config({**base, "repro": {**base["repro"], "early_steps": [9]}}), "repro")


def test_transient_steps_reported_one_by_one(tiny_tokens: Path, tmp_path: Path) -> None:
    arms = [
        {"name": "pw", "dispatch": "pooled_wave", "capacity_factor": 1.0, "transport_capacity_factor": 1.0},
        {"name": "rg", "dispatch": "ragged", "capacity_factor": 1.0},
    ]
    base = {
        "threads": 1,
        "inputs": {"tokens": str(tiny_tokens)},
        "model": {**TINY_MODEL, "n_experts": 8},
        "moe": {"ranks": 2},
        "train": {"steps": 8, "batch_size": 2, "checkpoint_every": 8},
        "repro": {
            "train_arm": "pw",
            "late_window": 1,
            "measure_batch_size": 6,
            "transient_steps": [2, 4],
            "arms": arms,
        },
    }
    res = run_repro(parse_config(base), tmp_path)
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    # Each transient step is measured with the step before it; the late window (8) with step 7.
    assert [s for s, r in rows.items() if "repro/rg/moe/drop_fraction" in r] == [1, 2, 3, 4, 7, 8]
    assert [t["step"] for t in res["transient"]] == [2, 4]
    for t in res["transient"]:  # each step's own value, not a median over the list
        assert t["drop"] == {a: rows[t["step"]][f"repro/{a}/moe/drop_fraction"] for a in ("pw", "rg")}
        assert t["demand_cv"]["group"] == rows[t["step"]]["repro/demand/group/cv"]
    text = (tmp_path / "repro_table.md").read_text()
    assert "Transient" in text and "| 4 |" in text
    with pytest.raises(ConfigError, match="transient_steps"):
        validate(parse_config({**base, "repro": {**base["repro"], "transient_steps": [0]}}), "repro")


RECIPES = Path(__file__).parents[2] / "recipes"


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("moe-repro*.yaml")))
def test_shipped_reproduction_recipes_validate(recipe: str) -> None:
    """Every reproduction recipe the docs tell people to run passes the checks made before compute,
    for each of its three commands, and names the domains its mixture draws from."""
    from workloads.moe.config import load_config

    cfg = load_config(RECIPES / recipe)
    for stage in ("data", "tokenize", "repro"):
        validate(cfg, stage)
    assert set(cfg.train.mixture) <= set(cfg.data.domains), (cfg.train.mixture, cfg.data.domains)
    assert cfg.repro.arms and cfg.repro.measure_batch_size % cfg.moe.ranks == 0


def test_a_stopped_reproduction_saves_its_step_and_resumes(tiny_tokens: Path, tmp_path: Path) -> None:
    """The repro stage (one router trained for hundreds of steps) stops like the training stages."""
    import os
    import signal
    import subprocess
    import sys
    import time

    steps = 120  # signalled at step 5 or so: the rest (seconds) is the margin for the signal to land
    arms = [{"name": "wf", "dispatch": "waterfilling", "capacity_factor": 1.05}]
    cfg = tmp_path / "repro.json"
    cfg.write_text(
        json.dumps(
            {
                "threads": 1,
                "inputs": {"tokens": str(tiny_tokens)},
                "model": {**TINY_MODEL, "n_experts": 8},
                "moe": {"ranks": 2},
                "train": {"steps": steps, "batch_size": 4, "checkpoint_every": 1000},
                "repro": {"train_arm": "wf", "late_window": 2, "arms": arms},
            }
        )
    )
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "workloads.moe", "repro", "--config", str(cfg), "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 5:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be stopped"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    done = len(metrics.read_text().splitlines())
    assert 5 <= done < steps and f"stopped by SIGTERM after step {done}; checkpoint saved" in stderr
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"step {done + 1}/{steps}" in rerun.stderr and f"step 1/{steps} " not in rerun.stderr, rerun.stderr
    rows = [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()]
    assert rows == list(range(1, steps + 1))  # resumed at the saved step: none lost, none twice
