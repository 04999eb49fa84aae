"""Stage `repro`: Marin's drop-fraction measurements on a small, trained MoE router.

One model is trained for real on the corpus with the `repro.train_arm` dispatch in its forward pass.
At every step, every layer's routing (the expert ids the trained router chose) is also dispatched
under every arm in `repro.arms` (measurement arms; they do not touch the forward pass), so all arms
see the same routing. Each arm's per-step `moe/drop_fraction` is logged and the report is the median
over the last `repro.late_window` steps.

Capacity scaling: this machine cannot keep Marin's mean demand mu per capacity unit (its ranks hold
524,288 assignments), so with `scale_capacity` each arm's cf is replaced by cf' such that
(cf' - 1) * sqrt(mu') = (cf - 1) * sqrt(mu), mu' being this run's mean demand on the same unit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .config import ArmConfig, Config
from .dispatch import DispatchSpec, dispatch
from .metrics import summarize
from .model import MoELM, RoutingRuntime
from .tracking import open_tracker
from .train import (
    CKPT,
    load_state,
    lr_at,
    make_optimizer,
    mixture_of,
    prepare,
    save_checkpoint,
    step_rng,
    truncate_jsonl,
)
from .util import atomic_write_text, pick_device, set_threads

# Marin's mean demand per capacity unit (marin-moe.md, section 4): EP 64, T = 65,536, K = 8.
MARIN_MU = {
    "fixed_all_to_all": {"cell": 2048.0},  # #7279: E256
    "pooled_wave": {"sender": 2731.0, "receiver": 29127.0},  # E384, W3
    "ragged": {"chunk": 262144.0},
    "waterfilling": {"pool": 524288.0},
}


def our_mu(dispatch_name: str, P: int, E: int, K: int, T: int, W: int, chunks: int) -> dict[str, float]:
    A = T * K
    El = E // P
    return {
        "fixed_all_to_all": {"cell": A / E},
        "pooled_wave": {"sender": A / (P * W), "receiver": P * A / (E * W)},
        "ragged": {"chunk": A / (chunks if El % chunks == 0 else 1)},
        "waterfilling": {"pool": float(A)},
    }.get(dispatch_name, {})


def scaled(cf: float, mu: float, mu_new: float) -> float:
    """cf' with (cf' - 1) * sqrt(mu_new) = (cf - 1) * sqrt(mu)."""
    return 1.0 + (cf - 1.0) * math.sqrt(mu / mu_new)


def arm_spec(arm: ArmConfig, P: int, E: int, K: int, T: int, scale: bool) -> tuple[DispatchSpec, dict[str, Any]]:
    cf, tcf = arm.capacity_factor, arm.transport_capacity_factor
    info: dict[str, Any] = {"marin_cf": cf, "marin_tcf": tcf if arm.dispatch == "pooled_wave" else None}
    scale = arm.scale if arm.scale is not None else scale
    if scale and arm.dispatch in MARIN_MU:
        mu = our_mu(arm.dispatch, P, E, K, T, arm.waves, arm.chunks)
        m = MARIN_MU[arm.dispatch]
        info["mu"] = mu
        info["marin_mu"] = m
        if arm.dispatch == "pooled_wave":
            tcf = scaled(tcf, m["sender"], mu["sender"])
            cf = scaled(cf, m["receiver"], mu["receiver"])
        else:
            (unit,) = m
            cf = scaled(cf, m[unit], mu[unit])
    info.update({"cf": cf, "tcf": tcf if arm.dispatch == "pooled_wave" else None})
    return DispatchSpec(arm.dispatch, P, E, cf, tcf, arm.waves, arm.chunks), info


def run_repro(cfg: Config, out: Path) -> dict[str, Any]:
    set_threads(cfg.threads)
    data, mc, _, lineage = prepare(cfg, "repro")
    mixture = mixture_of(cfg, data)
    data.check(mixture, mc.context, "train")
    device = pick_device(cfg.device)
    P, E, K = cfg.moe.ranks, mc.n_experts, mc.top_k
    B = cfg.train.batch_size
    T = (B // P) * mc.context
    arms = {a.name: arm_spec(a, P, E, K, T, cfg.repro.scale_capacity) for a in cfg.repro.arms}
    train_spec = arms[cfg.repro.train_arm][0] if cfg.repro.train_arm else DispatchSpec("dropless", P, E)

    torch.manual_seed(cfg.seed)
    model = MoELM(mc).to(device)
    opt = make_optimizer(model, cfg)
    start, tokens_seen = 0, 0
    if (out / CKPT).is_file():
        st = load_state(out / CKPT)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        start, tokens_seen = int(st["step"]), int(st["tokens_seen"])
        torch.set_rng_state(st["rng"]["torch"])
    truncate_jsonl(out / "metrics.jsonl", start)
    rt = RoutingRuntime(train_spec, qb=cfg.moe.qb, aux_loss_coef=cfg.moe.aux_loss_coef,
                        z_loss_coef=cfg.moe.z_loss_coef, record_routing=True)
    model.train()
    with open_tracker(out, "repro", cfg.to_dict(), cfg.wandb) as tr:
        for step in range(start, cfg.train.steps):
            t0 = time.perf_counter()
            x, y = data.batch(step_rng(cfg.seed, step, 1), B, mc.context, mixture, "train")
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            loss, lm = model(x.to(device), y.to(device), rt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            opt.step()
            model.apply_pending_qb()
            tokens_seen += int(x.numel())
            m: dict[str, Any] = {"train/loss": float(lm.detach()), "train/tokens_seen": tokens_seen}
            m.update(summarize(model.layer_stats()))
            t1 = time.perf_counter()
            for name, (spec, _) in arms.items():
                S = R = V = 0
                for layer in model.moe_layers():
                    assert layer.last_experts is not None
                    res = dispatch(layer.last_experts, spec)
                    S, R, V = S + res.sender_dropped, R + res.receiver_dropped, V + layer.last_experts.numel()
                m[f"repro/{name}/moe/drop_fraction"] = (S + R) / V
                m[f"repro/{name}/moe/sender_drop_fraction"] = S / V
                m[f"repro/{name}/moe/receiver_drop_fraction"] = R / V
            m["repro/measure_time_s"] = time.perf_counter() - t1
            m["train/step_time_s"] = t1 - t0
            tr.log(m, step + 1)
            done = step + 1 == cfg.train.steps
            if (step + 1) % cfg.train.checkpoint_every == 0 or done:
                save_checkpoint(out, model, opt, step + 1, tokens_seen, "repro", cfg, lineage)
        rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        late = rows[-cfg.repro.late_window:]
        table = []
        for a in cfg.repro.arms:
            vals = [r[f"repro/{a.name}/moe/drop_fraction"] for r in late]
            spec, info = arms[a.name]
            table.append({"arm": a.name, "dispatch": a.dispatch, "median_drop": statistics.median(vals),
                          "min": min(vals), "max": max(vals), "marin_drop": a.marin_drop,
                          "in_training_forward": a.name == cfg.repro.train_arm, **info})
        summary = {
            "train_arm": cfg.repro.train_arm, "late_window": [late[0]["step"], late[-1]["step"]],
            "tokens_per_rank": T, "sequences_per_rank": B // P, "ranks": P, "experts": E, "top_k": K,
            "experts_per_rank": E // P, "layers": mc.n_layers, "context": mc.context,
            "final_train_loss": rows[-1]["train/loss"], "first_train_loss": rows[0]["train/loss"],
            "model_config": dataclasses.asdict(mc), "wandb_run_id": tr.run_id, "table": table,
        }
        tr.summary({f"repro/{r['arm']}/late_median_drop": r["median_drop"] for r in table})
    atomic_write_text(out / "metrics.json", json.dumps(summary, indent=2, default=str))
    atomic_write_text(out / "repro_table.md", markdown_table(summary))
    return summary


def markdown_table(s: dict[str, Any]) -> str:
    lines = [
        "| arm | dispatch | Marin cf (tcf) | our cf' (tcf') | ours: late median drop [min, max] | Marin | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in s["table"]:
        mc = f"{r['marin_cf']}" + (f" ({r['marin_tcf']})" if r["marin_tcf"] else "")
        oc = f"{r['cf']:.4g}" + (f" ({r['tcf']:.4g})" if r["tcf"] else "")
        md = r["marin_drop"]
        ratio = f"{r['median_drop'] / md:.2f}" if md else "-"
        mark = " (train fwd)" if r["in_training_forward"] else ""
        lines.append(
            f"| {r['arm']}{mark} | {r['dispatch']} | {mc} | {oc} | {100 * r['median_drop']:.3f}% "
            f"[{100 * r['min']:.3f}, {100 * r['max']:.3f}] | {'' if md is None else f'{100 * md:.3f}%'} | {ratio} |"
        )
    return "\n".join(lines) + "\n"
