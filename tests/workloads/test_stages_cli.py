"""The six stages as subprocesses, chained end to end on tiny data, as `make demo` runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "workloads" / "moe" / "examples"
SHRINK = {
    "data": {"data": {"max_bytes_per_domain": 120_000, "max_sft_examples": 200}},
    "tokenize": {"tokenizer": {"vocab_size": 400}},
    "pretrain": {"train": {"steps": 4, "checkpoint_every": 2}},
    "midtrain": {"train": {"steps": 3, "checkpoint_every": 2}},
    "posttrain": {"train": {"steps": 2, "checkpoint_every": 2}},
    "eval": {"eval": {"batches": 1}},
}


def _stage(stage: str, tmp: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    cfg = yaml.safe_load((EXAMPLES / f"{stage}.yaml").read_text())
    for section, values in SHRINK[stage].items():
        cfg[section] = {**cfg.get(section, {}), **values}
    if "model" in cfg:
        cfg["model"]["context"] = 64
    cfg["inputs"] = {k: str(tmp / v.replace("runs/tiny/", "")) for k, v in cfg.get("inputs", {}).items()}
    path = tmp / f"{stage}.json"
    path.write_text(json.dumps(cfg))
    out = tmp / {"tokenize": "tokens"}.get(stage, stage)
    return subprocess.run(
        [sys.executable, "-m", "workloads.moe", stage, "--config", str(path), "--out", str(out), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_six_stage_chain_end_to_end(tmp_path: Path) -> None:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    for stage in ("data", "tokenize", "pretrain", "midtrain", "posttrain", "eval"):
        proc = _stage(stage, tmp_path, env)
        assert proc.returncode == 0, (stage, proc.stderr[-2000:])
        out = tmp_path / {"tokenize": "tokens"}.get(stage, stage)
        assert (out / "metrics.json").is_file(), stage
        if stage == "pretrain":
            _reports_progress_on_stderr(proc, out)
    assert (tmp_path / "tokens" / "tokenizer.json").is_file()
    pre = json.loads((tmp_path / "pretrain" / "checkpoint" / "meta.json").read_text())
    mid = json.loads((tmp_path / "midtrain" / "checkpoint" / "meta.json").read_text())
    assert mid["tokens_seen"] > pre["tokens_seen"]  # mid-train continues the count
    assert mid["lineage"]["checkpoint"].startswith(str(tmp_path / "pretrain"))
    ev = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert {"eval/code/loss", "eval/prose/loss", "eval/moe/drop_fraction"} <= set(ev)
    assert ev["wandb_run_id"] and list((tmp_path / "eval" / "wandb").glob("offline-run-*"))
    # Restarting a finished stage resumes from its checkpoint instead of training again; given more
    # steps, it trains those, counting from where it resumed, and `--json` ends stdout with every
    # scalar metric as JSON.
    proc = _stage("midtrain", tmp_path, env)
    assert (
        proc.returncode == 0
        and json.loads((tmp_path / "midtrain" / "metrics.json").read_text())["resumed_from_step"] == 3
    )
    proc = _stage("midtrain", tmp_path, env, "--set", "train.steps=5", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("step ")]
    assert lines[0].startswith("step 4/5 (80%)") and lines[-1].startswith("step 5/5"), lines
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    metrics = json.loads((tmp_path / "midtrain" / "metrics.json").read_text())
    assert result["resumed_from_step"] == 3 and result["train/loss"] == metrics["train/loss"], result


def _reports_progress_on_stderr(proc: subprocess.CompletedProcess[str], out: Path) -> None:
    """A training stage says how far it is (step, loss, drop, time per step, time left) on stderr, which a
    launcher streams into the Prefect logs: at its first step, at most every 10 s, and at its last.
    stdout ends with one line of headline figures (the log's last word on the stage)."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("step ")]
    assert lines[0].startswith("step 1/4 (25%) | loss ") and " | drop " in lines[0], lines
    assert "s/step | about " in lines[0] and lines[0].endswith(" left"), lines
    assert lines[-1].startswith("step 4/4 (100%)") and lines[-1].endswith(" | done"), lines
    assert len(lines) <= 4
    metrics = json.loads((out / "metrics.json").read_text())
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("done: step 4/4 | "), summary
    assert f" | loss {metrics['train/loss']:.4f} | drop {metrics['moe/drop_fraction']:.2%} | " in summary, summary
    assert f"eval loss code {metrics['eval/code/loss']:.4f}, " in summary, summary
    assert f" | eval drop {metrics['eval/moe/drop_fraction']:.2%} | W&B run {metrics['wandb_run_id']} | " in summary
    assert summary.endswith(f" | all metrics in {out}/metrics.json"), summary


def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("inputs: {tokens: /nonexistent}\nmoe: {dispatch: pooled_wave}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "workloads.moe", "pretrain", "--config", str(cfg), "--out", str(tmp_path / "o")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: inputs.tokens") and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr


def test_set_overrides_one_key_of_the_config(tmp_path: Path) -> None:
    """`--set KEY=VALUE` changes one key (value read as YAML) without a copy of the file; a malformed
    one is a one-line error before anything runs."""
    cfg = tmp_path / "data.yaml"
    cfg.write_text(yaml.safe_dump({"seed": 0, "data": {"max_bytes_per_domain": 50_000, "max_sft_examples": 20}}))

    def data(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "workloads.moe", "data", "--config", str(cfg), *extra],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    proc = data("--out", str(tmp_path / "d"), "--set", "seed=7", "--set", "data.max_sft_examples=5")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["seed"] == 7 and manifest["sft"]["train"]["examples"] == 5

    for bad, said in (
        ("seed", "expected KEY=VALUE"),
        ("seed.x=1", "'seed' is a value, not a section"),
        ("data..x=1", "expected KEY=VALUE"),
    ):
        proc = data("--out", str(tmp_path / "bad"), "--set", bad)
        assert proc.returncode == 2 and said in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert not (tmp_path / "bad").exists()


def test_a_number_in_scientific_notation_is_a_number_in_a_config_and_a_set() -> None:
    """`train.lr=1e-4` (and `lr: 1e-4` in a config file) was the text "1e-4" under PyYAML's rules,
    refused as "must be a number"; text that only looks like it stays text."""
    from workloads.moe.config import apply_overrides, load_yaml

    assert load_yaml("train: {lr: 1e-4, min_lr: 2.5E-5, steps: 1e2x}") == {
        "train": {"lr": 0.0001, "min_lr": 2.5e-05, "steps": "1e2x"}
    }
    # YAML 1.1's octal and base-60 integers (`010` was 8, `1:30` was 90) stay text, refused where a number goes
    assert load_yaml("train: {steps: 010, checkpoint_every: 1:30}") == {
        "train": {"steps": "010", "checkpoint_every": "1:30"}
    }
    with pytest.raises(Exception, match="found the key 'train' twice in one mapping"):
        load_yaml("train: {lr: 0.5}\ntrain: {steps: 3}")  # the first was dropped, lr 0.5 lost without a word
    assert apply_overrides({"train": {"lr": 0.01}}, ["train.lr=1e-4", "seed=12"]) == {
        "train": {"lr": 0.0001},
        "seed": 12,
    }


def test_extends_starts_from_another_config_and_lays_this_files_keys_on_top(tmp_path: Path) -> None:
    """A variant file holds only its differences (`extends: base.yaml`, relative to the file): mappings
    merge key by key, lists are replaced whole, `--set` still applies last; a missing base or a loop is a
    one-line error before anything is written."""
    (tmp_path / "base.yaml").write_text(
        yaml.safe_dump(
            {
                "seed": 3,
                "data": {"max_bytes_per_domain": 50_000, "max_sft_examples": 20, "heldout_fraction": 0.1},
                "repro": {"early_steps": [5, 6], "late_window": 9},
            }
        )
    )
    sub = tmp_path / "variants"
    sub.mkdir()
    (sub / "v.yaml").write_text("extends: ../base.yaml\ndata: {max_sft_examples: 7}\nrepro: {early_steps: [4]}\n")
    from workloads.moe.config import load_config

    cfg = load_config(sub / "v.yaml", ["seed=5"])
    assert (cfg.seed, cfg.data.max_bytes_per_domain, cfg.data.max_sft_examples, cfg.data.heldout_fraction) == (
        5,
        50_000,
        7,
        0.1,
    )
    assert cfg.repro.early_steps == [4] and cfg.repro.late_window == 9

    proc = subprocess.run(
        [sys.executable, "-m", "workloads.moe", "data", "--config", str(sub / "v.yaml"), "--out", str(tmp_path / "d")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["seed"] == 3 and manifest["sft"]["train"]["examples"] <= 7

    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    (tmp_path / "lost.yaml").write_text("extends: nowhere.yaml\n")
    (tmp_path / "odd.yaml").write_text("extends: [base.yaml]\n")
    for name, said in (
        ("a.yaml", "extends loops back on itself: a.yaml -> b.yaml -> a.yaml"),
        ("lost.yaml", "nowhere.yaml (extended by"),
        ("odd.yaml", "extends: expected the path"),
    ):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "workloads.moe",
                "data",
                "--config",
                str(tmp_path / name),
                "--out",
                str(tmp_path / "bad"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and said in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert not (tmp_path / "bad").exists()
