"""Benchmark (not a test): MoE training step vs a dense model with the same active parameters.

    python benchmarks/bench_moe_step.py [--steps 12] [--threads 2] [--device auto|cpu|cuda] [--batch 16]

Each variant runs in its own subprocess (so peak RSS is per variant) for the same number of
fwd+bwd+AdamW steps on the same random batch; the median step time is reported. Variants:
  dense            SwiGLU FFN of width K*expert_hidden + shared_hidden (same active parameters)
  moe_dropless     the MoE with no capacity limits (routing + gather/scatter + batched expert matmuls)
  moe_dropless_loop  the same with the per-expert Python loop the batched path replaced (for comparison)
  moe_pooled_wave  pooled-wave dispatch (tcf 1.05 / cf 1.33, W 3, P 4) in the forward, no metrics
  moe_pw_metrics   the same + every drop/routing metric computed (the per-step logging cost)
Targets (issue 6): moe / dense <= 1.5x; metrics <= 5% of a step. Prints a markdown table.
With a GPU (`--device auto` picks it, as the stages do) each step ends with a device synchronize, so
the time is the GPU's, and the peak GPU memory of each variant is reported beside its peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("dense", "moe_dropless", "moe_dropless_loop", "moe_pooled_wave", "moe_pw_metrics")
MODEL = {
    "vocab_size": 4096,
    "d_model": 128,
    "n_layers": 4,
    "n_heads": 4,
    "context": 256,
    "n_experts": 24,
    "top_k": 4,
    "expert_hidden": 64,
    "n_shared": 1,
    "shared_hidden": 128,
}
BATCH = 16  # sequences (4 per rank); --batch changes it, e.g. to fill a GPU


def _setup(name: str, threads: int, device_name: str, batch: int = BATCH):  # noqa: ANN202 - returns a closure over torch objects
    sys.path.insert(0, str(ROOT))
    import torch

    from workloads.moe.config import ModelConfig
    from workloads.moe.dispatch import DispatchSpec
    from workloads.moe.metrics import summarize
    from workloads.moe.model import MoELM, RoutingRuntime, count_params
    from workloads.moe.util import pick_device, setup_torch

    setup_torch(threads)  # as the stages run: this many threads, deterministic kernels
    torch.manual_seed(0)
    cfg = ModelConfig(**MODEL)
    device = pick_device(device_name)
    model = MoELM(cfg, dense=name == "dense").to(device)
    spec = DispatchSpec(
        "dropless" if name in ("dense", "moe_dropless", "moe_dropless_loop") else "pooled_wave",
        4,
        cfg.n_experts,
        1.33,
        1.05,
        3,
        2,
    )
    if name == "moe_dropless_loop":
        for layer in model.moe_layers():
            layer.grouped_max_padding = 0
    rt = RoutingRuntime(spec, collect_metrics=name == "moe_pw_metrics")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1)).to(device)
    metric_s = [0.0]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> float:
        sync()
        t0 = time.perf_counter()
        before = sum(m.metrics_time_s for m in model.moe_layers())
        loss, _ = model(x[:, :-1], x[:, 1:], rt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        model.apply_pending_qb()
        if rt.collect_metrics:
            t1 = time.perf_counter()
            summarize(model.layer_stats())
            metric_s[0] = time.perf_counter() - t1 + sum(m.metrics_time_s for m in model.moe_layers()) - before
        sync()
        return time.perf_counter() - t0

    expert_params = (cfg.n_experts - cfg.top_k) * 3 * cfg.d_model * cfg.expert_hidden * cfg.n_layers
    active = count_params(model) - (0 if name == "dense" else expert_params)
    return step, metric_s, count_params(model), active


def peak_memory(name: str, threads: int, device_name: str, batch: int) -> tuple[float, float]:
    """(peak RSS, peak GPU memory allocated by torch; 0 on CPU), MiB, of a few steps of one variant."""
    import torch

    step, *_ = _setup(name, threads, device_name, batch)
    for _ in range(3):
        step()
    gpu = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else 0.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, gpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences per step, a multiple of 4 (the ranks)")
    ap.add_argument("--rss-of", choices=VARIANTS)
    a = ap.parse_args()
    if a.batch < 4 or a.batch % 4:
        ap.error(f"--batch {a.batch}: must be a positive multiple of 4 (the 4 simulated ranks)")
    if a.rss_of:  # child process: peak memory of one variant alone
        print(*peak_memory(a.rss_of, a.threads, a.device, a.batch))
        return
    # Peak RSS first, while this parent is still small: Linux children inherit ru_maxrss across fork+exec.
    rss, gpu = {}, {}
    for v in VARIANTS:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--rss-of",
                v,
                "--threads",
                str(a.threads),
                "--device",
                a.device,
                "--batch",
                str(a.batch),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        rss[v], gpu[v] = map(float, out.stdout.strip().splitlines()[-1].split())
    # Timings: all variants in one process, interleaved step by step, so load from other processes
    # on a shared machine hits every variant alike; the median over steps is reported.
    setups = {v: _setup(v, a.threads, a.device, a.batch) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    metric_frac: list[float] = []
    for i in range(a.steps + 2):
        for v in VARIANTS:
            dt = setups[v][0]()
            if i >= 2:
                times[v].append(dt)
                if v == "moe_pw_metrics":
                    metric_frac.append(setups[v][1][0] / dt)
    med = {v: statistics.median(t) for v, t in times.items()}
    tokens = a.batch * MODEL["context"]
    on_gpu = any(gpu.values())
    where = f"device {a.device} ({'GPU' if on_gpu else 'CPU'}), {a.threads} CPU threads"
    print(
        f"model {MODEL}, batch {a.batch}x{MODEL['context']} = {tokens} tokens/step, "
        f"{where}, median of {a.steps} interleaved steps\n"
    )
    print(
        "| variant | params | active params | step (s) | tokens/s | vs dense | peak RSS (MiB) |"
        + (" peak GPU (MiB) |" if on_gpu else "")
    )
    print("|---|---|---|---|---|---|---|" + ("---|" if on_gpu else ""))
    for v in VARIANTS:
        _, _, n, act = setups[v]
        print(
            f"| {v} | {n / 1e6:.2f}M | {act / 1e6:.2f}M | {med[v]:.3f} | {tokens / med[v]:.0f} | "
            f"{med[v] / med['dense']:.2f}x | {rss[v]:.0f} |" + (f" {gpu[v]:.0f} |" if on_gpu else "")
        )
    delta = med["moe_pw_metrics"] / med["moe_pooled_wave"] - 1
    print(
        f"\ndrop/routing metrics cost, timed directly: {100 * statistics.median(metric_frac):.2f}% of a step "
        f"(difference of step medians: {100 * delta:+.1f}%; target <= 5%)"
    )


if __name__ == "__main__":
    main()
