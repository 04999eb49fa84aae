"""The reproduction stage: capacity scaling arithmetic and a short run producing the table."""

from __future__ import annotations

import json
import math
from pathlib import Path

from workloads.moe.config import ArmConfig, parse_config
from workloads.moe.repro import arm_spec, our_mu, run_repro, scaled

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


def test_short_repro_run_reports_every_arm(tiny_tokens: Path, tmp_path: Path) -> None:
    arms = [
        {"name": "fixed1", "dispatch": "fixed_all_to_all", "capacity_factor": 1.0, "marin_drop": 0.0741},
        {"name": "pw", "dispatch": "pooled_wave", "capacity_factor": 1.33, "transport_capacity_factor": 1.05},
        {"name": "ragged", "dispatch": "ragged", "capacity_factor": 1.15},
        {"name": "wf", "dispatch": "waterfilling", "capacity_factor": 1.05},
    ]
    cfg = parse_config({
        "threads": 1, "inputs": {"tokens": str(tiny_tokens)},
        "model": {**TINY_MODEL, "n_experts": 8}, "moe": {"ranks": 2},
        "train": {"steps": 4, "batch_size": 4, "checkpoint_every": 2},
        "repro": {"train_arm": "pw", "late_window": 2, "arms": arms},
    })
    res = run_repro(cfg, tmp_path)
    assert [r["arm"] for r in res["table"]] == ["fixed1", "pw", "ragged", "wf"]
    assert [r["in_training_forward"] for r in res["table"]] == [False, True, False, False]
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    late = sorted(r["repro/fixed1/moe/drop_fraction"] for r in rows[-2:])
    assert math.isclose(res["table"][0]["median_drop"], sum(late) / 2)
    assert "| fixed1 |" in (tmp_path / "repro_table.md").read_text()
