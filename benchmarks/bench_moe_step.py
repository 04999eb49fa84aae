"""Benchmark (not a test): MoE training step vs a dense model with the same active parameters.

    python benchmarks/bench_moe_step.py [--steps 12] [--threads 2]

Each variant runs in its own subprocess (so peak RSS is per variant) for the same number of
fwd+bwd+AdamW steps on the same random batch; the median step time is reported. Variants:
  dense            SwiGLU FFN of width K*expert_hidden + shared_hidden (same active parameters)
  moe_dropless     the MoE with no capacity limits (routing + gather/scatter + per-expert matmuls)
  moe_pooled_wave  pooled-wave dispatch (tcf 1.05 / cf 1.33, W 3, P 4) in the forward, no metrics
  moe_pw_metrics   the same + every drop/routing metric computed (the per-step logging cost)
Targets (issue 6): moe / dense <= 1.5x; metrics <= 5% of a step. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("dense", "moe_dropless", "moe_pooled_wave", "moe_pw_metrics")
MODEL = {"vocab_size": 4096, "d_model": 128, "n_layers": 4, "n_heads": 4, "context": 256, "n_experts": 24,
         "top_k": 4, "expert_hidden": 64, "n_shared": 1, "shared_hidden": 128}
BATCH = 16  # sequences: 4 per rank


def run_variant(name: str, steps: int, threads: int) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    import torch

    from workloads.moe.config import ModelConfig
    from workloads.moe.dispatch import DispatchSpec
    from workloads.moe.metrics import summarize
    from workloads.moe.model import MoELM, RoutingRuntime, count_params

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = ModelConfig(**MODEL)
    model = MoELM(cfg, dense=name == "dense")
    spec = DispatchSpec("dropless" if name in ("dense", "moe_dropless") else "pooled_wave", 4, cfg.n_experts,
                        1.33, 1.05, 3, 2)
    rt = RoutingRuntime(spec, collect_metrics=name == "moe_pw_metrics")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (BATCH, cfg.context + 1))
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        loss, _ = model(x[:, :-1], x[:, 1:], rt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        model.apply_pending_qb()
        if rt.collect_metrics:
            summarize(model.layer_stats())
        if i >= 2:  # skip warm-up
            times.append(time.perf_counter() - t0)
    active = count_params(model) if name == "dense" else count_params(model) - sum(
        (cfg.n_experts - cfg.top_k) * 3 * cfg.d_model * cfg.expert_hidden for _ in range(cfg.n_layers))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"step_s": statistics.median(times), "peak_rss_mib": peak, "params": count_params(model),
            "active_params": active}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", choices=VARIANTS)
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(run_variant(a.variant, a.steps, a.threads)))
        return
    res = {}
    for v in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--variant", v, "--steps", str(a.steps),
                              "--threads", str(a.threads)], capture_output=True, text=True, check=True)
        res[v] = json.loads(out.stdout.strip().splitlines()[-1])
    d = res["dense"]["step_s"]
    tokens = BATCH * MODEL["context"]
    print(f"model {MODEL}, batch {BATCH}x{MODEL['context']} = {tokens} tokens/step, "
          f"{a.threads} threads, median of {a.steps} steps\n")
    print("| variant | params | active params | step (s) | tokens/s | vs dense | peak RSS (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        r = res[v]
        print(f"| {v} | {r['params'] / 1e6:.2f}M | {r['active_params'] / 1e6:.2f}M | {r['step_s']:.3f} | "
              f"{tokens / r['step_s']:.0f} | {r['step_s'] / d:.2f}x | {r['peak_rss_mib']:.0f} |")
    m = res["moe_pw_metrics"]["step_s"] / res["moe_pooled_wave"]["step_s"] - 1
    print(f"\ndrop/routing metrics cost: {100 * m:+.1f}% of a pooled-wave step (target <= 5%)")


if __name__ == "__main__":
    main()
