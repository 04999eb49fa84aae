"""The real MoE workload through the pipeline from a terminal: the token-dropping reproduction, and a
preempted training stage. (The tiny replica end to end, then reused by ``openlab run``: test_demo.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def openlab_run(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", "from orchestrator.cli.run import app; app()", "run", "marin-535b-a23b", *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_drops_replica_runs_the_reproduction_stage_with_lineage_then_reuses() -> None:
    """The token-dropping reproduction through the pipeline: data -> tokenize -> repro, the headline
    late-window medians recorded on the repro stage run (what the nightly verdict compares), its W&B
    run linked; a second run reuses all three stages."""
    from orchestrator.lineage import LineageStore, StageRun, WandbRun
    from orchestrator.lineage.verify import anchor_of
    from orchestrator.links.wandb import find_run_dirs, read_run_dir
    from orchestrator.provenance.invocation import current_user
    from orchestrator.settings import load_settings

    # `--until tokenize` prepares the data now; the full run then reuses it and trains.
    prep = openlab_run("--replica", "drops-tiny", "--until", "tokenize", "--json")
    assert prep["state"] == "COMPLETED", prep["error"]
    assert [(s["stage"], s["state"]) for s in prep["stages"]] == [("data", "COMPLETED"), ("tokenize", "COMPLETED")]
    assert prep["recipe_lineage"]["stages"] == ["data", "tokenize"]
    # A value set to what the recipe has (`--set`) changes no identity: the next run without it reuses all.
    first = openlab_run("--replica", "drops-tiny", "--set", "repro.train.warmup_steps=2", "--json")
    assert first["state"] == "COMPLETED", first["error"]
    assert [(s["stage"], s["state"]) for s in first["stages"]] == [
        ("data", "REUSED"),
        ("tokenize", "REUSED"),
        ("repro", "COMPLETED"),
    ]
    repro = first["stages"][-1]
    headline = repro["metrics"]["repro"]
    assert set(headline) == {"pooled_wave_1.05_1.33", "pooled_wave_1.15_1.15", "ragged_cf1.15", "waterfilling_cf1.05"}
    assert all(0.0 <= v["late_median_drop"] <= 1.0 and v["late_median_drop_se"] >= 0.0 for v in headline.values())
    assert repro["metrics"]["late_window"] == [9, 12] and repro["metrics"]["measure_batch_size"] == 16
    assert first["recipe_lineage"]["stages"] == ["data", "tokenize", "repro"]
    with LineageStore.open(load_settings()) as store:
        srun = store.require(StageRun, repro["stage_run_id"])
        assert srun.state == "COMPLETED" and srun.metrics["repro"] == headline
        linked = {r.object_kind for r in store.relations(srun.id) if r.subject_id == srun.id}
        (wrun,) = [
            store.require(WandbRun, r.object_id) for r in store.relations(srun.id) if r.object_kind == "wandb_run"
        ]
        anchor = anchor_of(store, first["pipeline_run_id"])
    assert {"wandb_run", "artifact"} <= linked, linked  # its W&B run and the token shards it used
    # the W&B run (public once synced) carries the run's lineage anchor too, read back from its files
    back = read_run_dir(find_run_dirs(str(wrun.local_dir), wrun.run_id)[0])
    assert anchor is not None and back.config["openlab"]["lineage_anchor"] == str(anchor), back.config
    # ... and how the run was started and as whom: a W&B workspace filters the nightlies on the tag
    assert "trigger-terminal" in back.tags, back.tags
    assert back.config["openlab"]["user"] == current_user(), back.config
    assert back.config["openlab"]["run_set"] == ["repro.train.warmup_steps=2"], back.config  # what the run set
    second = openlab_run("--replica", "drops-tiny", "--json")
    states = [(s["stage"], s["state"], s["reason"]) for s in second["stages"]]
    assert [s[1] for s in states] == ["REUSED"] * 3, states


def _workload_pids(stage: str, under: Path) -> list[int]:
    """The stage's training process writing under ``under`` (this test's artifacts: another xdist
    worker may be training too), not the local backend's supervisor, whose argv repeats it."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        ours = any(a.startswith(str(under).encode()) for a in argv)
        if b"workloads.moe" in argv and stage.encode() in argv and ours and not any(b"_supervise" in a for a in argv):
            pids.append(int(cmdline.parent.name))
    return pids


def test_a_preempted_training_stage_resumes_from_its_checkpoint_in_a_new_attempt() -> None:
    """Preemption, as a scheduler does it: SIGTERM to the running pretrain job. The workload saves
    its step and exits 143; the attempt is PREEMPTED; with no retries the pipeline still finishes,
    because the next attempt of the same stage run resumes at that step: every step trained once."""
    import os
    import signal
    import threading
    import time

    from orchestrator.lineage import Attempt, LineageStore, Relation, StageRun
    from orchestrator.pipeline import PipelineHooks, RunOptions, moe_pipeline, run_stages, start_pipeline
    from orchestrator.recipes import resolve
    from orchestrator.settings import load_settings

    steps = 60  # stopped at step 5 or so: the rest is trained once, by the second attempt
    resolved = resolve("marin-535b-a23b", "tiny").until("pretrain")
    configs = {name: dict(cfg) for name, cfg in resolved.stage_configs.items()}
    configs["pretrain"]["train"] = {**configs["pretrain"]["train"], "steps": steps, "checkpoint_every": steps}
    pipeline = moe_pipeline(stages=resolved.stages, resources=resolved.resources)
    settings = load_settings()
    seen: list[tuple[str, str]] = []
    lines: list[str] = []
    hooks = PipelineHooks(on_transition=lambda e: (seen.append((e.stage, e.state)), lines.append(e.line())))
    ctx = start_pipeline(
        pipeline, configs, options=RunOptions(backend="local"), hooks=hooks, settings=settings, recipe=resolved
    )  # the recipe's W&B project: pretrain logs to a W&B run (offline)
    stopped: dict[str, int] = {}

    def preempt_pretrain() -> None:  # once pretrain has trained a few steps
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not stopped:
            for metrics in settings.artifacts_dir.glob("pretrain/*/metrics.jsonl"):
                if len(metrics.read_text().splitlines()) >= 5:
                    for pid in _workload_pids("pretrain", settings.artifacts_dir):
                        os.kill(pid, signal.SIGTERM)
                        stopped["pid"] = pid
            time.sleep(0.02)

    killer = threading.Thread(target=preempt_pretrain, daemon=True)
    killer.start()
    result = run_stages(ctx, retries=0)
    killer.join(5)
    assert stopped, "pretrain was signalled while it ran"
    assert result.state == "COMPLETED", result.error
    assert ("pretrain", "PREEMPTED") in seen and ("pretrain", "RETRYING") not in seen
    # the stage's time is both jobs', not the last one's alone
    (done_line,) = [line for line in lines if line.startswith("pretrain COMPLETED")]
    took = re.match(r"pretrain COMPLETED in ([\d.]+) s, ([\d.]+) s in all over 2 jobs \(1 stopped", done_line)
    assert took and float(took[2]) > float(took[1]) > 0, done_line
    with LineageStore.open(settings) as store:
        (pretrain,) = store.list(StageRun, pipeline_run_id=result.pipeline_run.id, stage="pretrain")
        first, second = store.list(Attempt, stage_run_id=pretrain.id, order_by=Attempt.number)
        assert (first.state, first.exit_code, second.state) == ("PREEMPTED", 143, "COMPLETED")
        assert (first.progress_saved, second.progress_saved) == (True, None), "saved on SIGTERM: not lost hours"
        # its W&B run was linked when the job was preempted (as W&B then said: preempted), and the
        # same run, resumed, when it finished: a person sees the curve of a stopped job too
        linked = store.list(Relation, where=[Relation.subject_id == pretrain.id, Relation.object_kind == "wandb_run"])
        (wandb_id,) = {r.object_id for r in linked}
        states = [e.payload.get("state") for e in store.events(wandb_id)]
        assert states[0] == "preempted" and states[-1] == "finished", states
    log = Path(first.log_path).read_text()
    done = int(log.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert 5 <= done < steps
    assert f" | resumed from step {done} | " in Path(second.log_path).read_text()  # the stage's last line
    (metrics,) = settings.artifacts_dir.glob("pretrain/*/metrics.jsonl")
    trained = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]
    assert trained == list(range(1, steps + 1)), "no step lost or trained twice across the preemption"
