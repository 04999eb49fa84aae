"""Routing and drop metrics with Marin's names and definitions (marin-moe.md section 3).

Per layer the model reports selected-expert counts c_e, the router logits' statistics and the
dispatch drop counts; `summarize` turns a list of per-layer records into the logged dict. Counts are
summed on the host in Python ints (Marin: int64 on the host) so fractions are exact ratios.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class LayerStats:
    counts: list[int]  # c_e: global count of assignments selecting expert e (valid tokens)
    sender_dropped: int = 0
    receiver_dropped: int = 0
    entropy: float = 0.0
    load_balancing_loss: float = 0.0
    router_z_loss: float = 0.0
    #: Tokens routed and the mean router softmax over them: what `combine` needs to give the
    #: load-balancing loss of several batches together (it is not a mean of their losses).
    tokens: int = 0
    p_mean: list[float] = field(default_factory=list)

    @property
    def valid(self) -> int:
        return sum(self.counts)


def combine(parts: list[LayerStats]) -> LayerStats:
    """One layer's statistics over several batches (the tasks of a data-parallel job) as if routed
    as one batch: counts and drops add, the entropy is recomputed from the summed counts, the
    z-loss is the token-weighted mean, and the balancing loss E * sum_e (c_e / N) * mean_t p_te
    uses the summed counts and the token-weighted mean softmax."""
    if len(parts) == 1:
        return parts[0]
    counts = [sum(c) for c in zip(*(p.counts for p in parts), strict=True)]
    n = sum(p.tokens for p in parts)
    if not n:
        raise ValueError("combining layer statistics needs each part's token count")
    p_mean = [sum(p.tokens * p.p_mean[e] for p in parts) / n for e in range(len(counts))]
    lb = len(counts) * sum(c / n * pm for c, pm in zip(counts, p_mean, strict=True))
    return LayerStats(
        counts=counts,
        sender_dropped=sum(p.sender_dropped for p in parts),
        receiver_dropped=sum(p.receiver_dropped for p in parts),
        entropy=float(routing_entropy(torch.tensor(counts))),
        load_balancing_loss=lb,
        router_z_loss=sum(p.tokens * p.router_z_loss for p in parts) / n,
        tokens=n,
        p_mean=p_mean,
    )


def routing_entropy(counts: torch.Tensor) -> torch.Tensor:
    """-sum_e f_e ln(f_e + 1e-6), f_e = c_e / sum c."""
    f = counts.double() / counts.sum().clamp(min=1)
    return -(f * torch.log(f + 1e-6)).sum()


def load_balancing_loss(counts: torch.Tensor, logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """E * sum_e (K f_e) * mean_t softmax(s)_e; uniform routing gives K. Differentiable in logits."""
    E = logits.shape[-1]
    f = counts.to(logits.dtype) / counts.sum().clamp(min=1)
    p_mean = torch.softmax(logits, dim=-1).mean(0)
    return E * ((top_k * f) * p_mean).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean_t (logsumexp_e s_te)^2. Differentiable in logits."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


def routing_hist(counts: list[int]) -> dict[str, float | list[int]]:
    """Unit buckets [e, e+1) holding c_e plus the summary fields Marin logs beside the histogram."""
    nz = [i for i, c in enumerate(counts) if c]
    return {
        "counts": list(counts),
        "min": float(nz[0]) if nz else 0.0,
        "max": float(nz[-1]) if nz else 0.0,
        "num": float(sum(counts)),
        "sum": float(sum(c * i for i, c in enumerate(counts))),
        "sum_squares": float(sum(c * i * i for i, c in enumerate(counts))),
    }


def summarize(layers: list[LayerStats], prefix: str = "", hist: bool = True) -> dict[str, object]:
    """The logged metric dict for one step (or one eval pass) from per-layer records."""
    if not layers:
        return {}
    S = sum(ls.sender_dropped for ls in layers)
    R = sum(ls.receiver_dropped for ls in layers)
    V = sum(ls.valid for ls in layers)
    D = S + R
    out: dict[str, object] = {
        "moe/drop_fraction": D / V if V else 0.0,
        "moe/sender_drop_fraction": S / V if V else 0.0,
        "moe/receiver_drop_fraction": R / V if V else 0.0,
        "moe/receiver_drop_fraction_of_received": R / (V - S) if V - S else 0.0,
        "moe/skipped_padding_fraction": 0.0,  # whole sequences, no padding in this workload
    }
    rates, srates, rrates = [], [], []
    for i, ls in enumerate(layers):
        v = ls.valid or 1
        rates.append((ls.sender_dropped + ls.receiver_dropped) / v)
        srates.append(ls.sender_dropped / v)
        rrates.append(ls.receiver_dropped / v)
        out[f"train/router/layer_{i}/capacity_overflow_rate"] = rates[-1]
        out[f"layer_{i}/routing_entropy"] = ls.entropy
        if hist:
            out[f"layer_{i}/routing_hist"] = routing_hist(ls.counts)
    n = len(layers)
    out["train/router/capacity_overflow_rate_mean"] = sum(rates) / n
    out["train/router/sender_capacity_overflow_rate_mean"] = sum(srates) / n
    out["train/router/receiver_capacity_overflow_rate_mean"] = sum(rrates) / n
    out["routing_entropy"] = sum(ls.entropy for ls in layers) / n
    out["load_balancing_loss"] = sum(ls.load_balancing_loss for ls in layers) / n
    out["router_z_loss"] = sum(ls.router_z_loss for ls in layers) / n
    if prefix:
        out = {f"{prefix}{k}": v for k, v in out.items()}
    return out


def max_load_ratio(counts: list[int]) -> float:
    """max_e c_e / mean_e c_e: 1.0 is perfectly balanced (used by tests and the QB check)."""
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else math.nan
