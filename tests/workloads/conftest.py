"""Shared tiny corpus + tokens (built once per session, in-process) for the workload tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from workloads.moe.config import parse_config
from workloads.moe.data import run_data
from workloads.moe.tokenizing import run_tokenize

TINY_MODEL = {
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 2,
    "context": 32,
    "n_experts": 4,
    "top_k": 2,
    "expert_hidden": 32,
    "n_shared": 1,
    "shared_hidden": 32,
}


@pytest.fixture(scope="session")
def tiny_tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("moe")
    data_cfg = parse_config({"data": {"max_bytes_per_domain": 150_000, "max_sft_examples": 300}})
    run_data(data_cfg, root / "data")
    tok_cfg = parse_config({"inputs": {"corpus": str(root / "data")}, "tokenizer": {"vocab_size": 512}})
    run_tokenize(tok_cfg, root / "tokens")
    return root / "tokens"


def train_cfg(tokens: Path, **train: Any) -> dict[str, Any]:
    return {
        "seed": 0,
        "threads": 1,
        "inputs": {"tokens": str(tokens)},
        "model": dict(TINY_MODEL),
        "moe": {"dispatch": "pooled_wave", "ranks": 2, "capacity_factor": 1.25, "transport_capacity_factor": 1.1},
        "train": {"steps": 6, "batch_size": 4, "lr": 0.01, "warmup_steps": 2, "checkpoint_every": 100, **train},
    }
