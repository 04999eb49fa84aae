"""Benchmark (not a test): a data-parallel training step, openlab's averaging against torch's DDP.

    python benchmarks/bench_data_parallel.py [--steps 12] [--tasks 2] [--batch 16]

A training stage run as several tasks (workloads/moe/distributed.py) averages gradients itself:
one flat all-reduce after the backward pass. What a user would otherwise write is
``torch.nn.parallel.DistributedDataParallel`` (bucketed all-reduces overlapped with the backward;
``find_unused_parameters`` because an expert may get no token). Both run in the same processes,
one after the other, on the same model, the same per-task batch and the same balancing step,
started by openlab's local task runner (``python -m orchestrator.launchers._tasks``, the contract
srun gives); one process on the whole global batch is the baseline. openlab's step also does what
a training stage does beyond the averaging: the loss-token weighting (one small all-reduce) and
gathering every task's routing statistics to task 0 for the logged global metrics; their share of
the step is reported. Reported: median seconds per step after two warm-up steps, and the ratio
openlab / DDP. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_moe_step import MODEL  # noqa: E402 - the model the MoE step benchmark times

#: Task 0's step times, as printed under the task runner (``0: [...]``) or alone (``[...]``).
TIMES = re.compile(r"^(?:\d+: )?(\[[0-9.eE, +-]*\])$")
#: Task 0's seconds per step spent on the global metrics and loss weighting (openlab's variant).
EXTRA = re.compile(r"^(?:\d+: )?extra (\[[0-9.eE, +-]*\])$")


def _measure(variant: str, steps: int, batch: int, threads: int) -> tuple[list[float], list[float]]:
    """Step times of one variant in this process (one of the job's tasks, or alone), and the part
    of each spent on the global metrics and loss weighting."""
    import torch

    from workloads.moe.config import ModelConfig
    from workloads.moe.dispatch import DispatchSpec
    from workloads.moe.distributed import DataParallel
    from workloads.moe.model import MoELM, RoutingRuntime
    from workloads.moe.util import setup_torch

    setup_torch(threads)
    torch.manual_seed(0)
    cfg = ModelConfig(**MODEL)
    dp = DataParallel.from_env(torch.device("cpu"), batch, 1) if variant != "one process" else DataParallel()
    model = MoELM(cfg)
    train = model
    if variant == "DDP":
        from torch.nn.parallel import DistributedDataParallel

        train = DistributedDataParallel(model, find_unused_parameters=True)
    rt = RoutingRuntime(DispatchSpec("dropless", 1, cfg.n_experts, 1.0, 1.05, 3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), generator=gen)
    (mine,) = dp.shard(x)
    times, extra = [], []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        loss, lm = train(mine[:, :-1], mine[:, 1:], rt)
        spent = 0.0
        if variant == "openlab":  # as train.py: each task's share of the loss tokens (1.0 here)
            t1 = time.perf_counter()
            loss = loss + (dp.loss_weight(mine[:, 1:]) - 1.0) * lm
            spent += time.perf_counter() - t1
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if variant == "openlab":
            dp.average_gradients(model)
        opt.step()
        dp.average_routing_balance(model)
        model.apply_pending_qb()
        if variant == "openlab":  # as train.py: task 0 logs the global batch's routing metrics
            t1 = time.perf_counter()
            dp.global_stats(model.layer_stats())
            spent += time.perf_counter() - t1
        dp.barrier()  # a step ends when every task has ended it
        times.append(time.perf_counter() - t0)
        extra.append(spent)
    if variant != "one process":
        dp.close()
    return times[2:], extra[2:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="global batch, in sequences (a multiple of --tasks)")
    ap.add_argument("--variant", choices=("one process", "openlab", "DDP"))
    a = ap.parse_args()
    if a.variant:  # a child: one variant, its times on stdout (task 0 only)
        threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE") or 1))
        times, extra = _measure(a.variant, a.steps, a.batch, threads)
        if int(os.environ.get("RANK") or 0) == 0:
            print(json.dumps(times))
            print("extra", json.dumps(extra))
        return
    if a.batch % a.tasks:
        ap.error(f"--batch {a.batch} must be a multiple of --tasks {a.tasks}")
    rows, extras = {}, {}
    for variant in ("one process", "openlab", "DDP"):
        cmd = [sys.executable, __file__, "--variant", variant, "--steps", str(a.steps), "--batch", str(a.batch)]
        if variant != "one process":
            cmd = [sys.executable, "-m", "orchestrator.launchers._tasks", str(a.tasks), "--", *cmd]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
        (times,) = [m.group(1) for ln in out.stdout.splitlines() if (m := TIMES.match(ln))]  # task 0's line
        rows[variant] = statistics.median(json.loads(times))
        (spent,) = [m.group(1) for ln in out.stdout.splitlines() if (m := EXTRA.match(ln))]
        extras[variant] = statistics.median(json.loads(spent))
    cores = os.cpu_count()
    print(f"| data-parallel step, global batch {a.batch} x {MODEL['context']} tokens, {cores} cores | s/step |")
    print("|---|---|")
    print(f"| one process, {os.cpu_count()} threads | {rows['one process']:.3f} |")
    print(f"| {a.tasks} tasks, openlab's averaging (one flat all-reduce) | {rows['openlab']:.3f} |")
    print(f"| {a.tasks} tasks, torch DDP (bucketed, find_unused_parameters) | {rows['DDP']:.3f} |")
    print(
        f"\nopenlab / DDP: {rows['openlab'] / rows['DDP']:.2f}x; {a.tasks} tasks / one process: "
        f"{rows['openlab'] / rows['one process']:.2f}x; openlab's global metrics and loss weighting: "
        f"{extras['openlab'] / rows['openlab']:.1%} of its step"
    )


if __name__ == "__main__":
    main()
