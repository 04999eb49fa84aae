"""Expert-parallel dispatch simulated inside one process (Marin grug MoE, see docs/moe-reproduction.md).

The N routed tokens are split into P ranks of whole sequences: rank r holds tokens [r*T, (r+1)*T), in
order, so the global flat assignment index a = t*K + k is "sender-major, then token order". Experts are
split evenly: rank d owns experts [d*E_l, (d+1)*E_l). Each scheme returns a keep-mask over the [N, K]
assignments plus sender- and receiver-side drop counts; the model multiplies dropped assignments by
zero (no renormalization), which is exactly what a real EP run computes, without the communication.

Everything is vectorized with stable sorts: "rank within a group in a given order" is the only
primitive the four schemes need, and the stable sort on the flat index gives token-order tie-breaking
for free. No Python loop touches tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

DISPATCHES = ("dropless", "fixed_all_to_all", "pooled_wave", "ragged", "waterfilling")


@dataclass(frozen=True)
class DispatchSpec:
    """Runtime dispatch settings; `capacity_factor` is the receiver cf for pooled_wave."""

    name: str
    ranks: int
    n_experts: int
    capacity_factor: float = 1.0
    transport_capacity_factor: float = 1.05
    waves: int = 3
    chunks: int = 2

    def __post_init__(self) -> None:
        if self.name not in DISPATCHES:
            raise ValueError(f"unknown dispatch '{self.name}' (choose one of {', '.join(DISPATCHES)})")
        if self.n_experts % self.ranks:
            raise ValueError(f"n_experts={self.n_experts} not divisible by ranks={self.ranks}")


@dataclass
class DispatchResult:
    keep: torch.Tensor  # bool [N, K]; None-equivalent (all True) for dropless
    sender_dropped: int
    receiver_dropped: int

    @property
    def dropped(self) -> int:
        return self.sender_dropped + self.receiver_dropped


def _ceil(x: float) -> int:
    """Ceil that ignores float dust (cf*A/E = 2176.0000000002 must give 2176, as the exact product does)."""
    return math.ceil(round(x, 6))


def _stable_argsort(key: torch.Tensor) -> torch.Tensor:
    """Stable argsort of non-negative integer keys; on CPU through NumPy, whose stable sort is a radix
    sort for 16-bit keys (the common case: a group id) and a timsort otherwise, both faster than
    torch's stable sort on int64 at millions of elements."""
    if key.device.type != "cpu":
        return torch.argsort(key, stable=True)
    k = key.numpy()
    hi = int(k.max())
    if hi < 2**15:
        k = k.astype(np.int16)
    elif hi < 2**31:
        k = k.astype(np.int32)
    return torch.from_numpy(np.argsort(k, kind="stable"))


def rank_within_group(group: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """0-based rank of every element among the elements of its group.

    Elements are ranked by `order` (ascending) and, on equal `order` or when `order` is None, by their
    position, so the flat token order breaks every tie. `group` and `order` are non-negative integers.
    """
    n = group.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=group.device)
    group = group.long()
    if order is None:
        key = group
    else:
        order = order.long()
        key = group * (int(order.max()) + 1) + order  # one stable sort by (group, order, position)
    idx = _stable_argsort(key)
    g = group[idx]
    pos = torch.arange(n, device=group.device)
    if int(g[-1]) < n:  # small group ids: a group starts at the count of all smaller ids
        counts = torch.bincount(g)
        first_of = torch.cumsum(counts, 0) - counts
        ranks = torch.empty_like(pos)
        ranks[idx] = pos - first_of[g]
        return ranks
    start = torch.ones(n, dtype=torch.bool, device=group.device)
    start[1:] = g[1:] != g[:-1]
    first = torch.cummax(torch.where(start, pos, torch.zeros_like(pos)), 0).values
    ranks = torch.empty_like(pos)
    ranks[idx] = pos - first
    return ranks


def capacities(spec: DispatchSpec, tokens_per_rank: int, top_k: int) -> dict[str, int]:
    """The integer capacities each scheme uses (no padding, so V_loc = A and V = P*A)."""
    P, E, W = spec.ranks, spec.n_experts, spec.waves
    El = E // P
    A = tokens_per_rank * top_k
    V = P * A
    cf, tcf = spec.capacity_factor, spec.transport_capacity_factor
    out: dict[str, int] = {}
    if spec.name == "fixed_all_to_all":
        out["cell"] = max(1, _ceil(cf * A / E))
    elif spec.name == "pooled_wave":
        out["sender_slots"] = min(max(_ceil(tcf * A / (P * W)), 1), _ceil(tcf * A / (P * W)))
        out["receiver"] = min(max(_ceil(cf * V / (E * W)), 1), _ceil(cf * A / (El * W)))
    elif spec.name == "ragged":
        chunks = spec.chunks if El % spec.chunks == 0 else 1
        c = min(max(_ceil(cf * V / P), El), max(El, _ceil(cf * A)))
        out["rank"] = c
        out["chunks"] = chunks
        out["chunk"] = max(El // chunks, _ceil(c / chunks))
    elif spec.name == "waterfilling":
        out["expert"] = min(max(1, _ceil(cf * P * A / E)), P * A)
    return out


def _cached(cache: dict[str, torch.Tensor] | None, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


def dispatch(experts: torch.Tensor, spec: DispatchSpec, cache: dict[str, torch.Tensor] | None = None) -> DispatchResult:
    """Decide which of the [N, K] assignments survive `spec`'s capacity gates.

    `experts[t, k]` is the global expert id of token t's k-th choice; N must be divisible by P.
    `cache`, when given, holds the token-order ranks that depend only on the routing (per cell, per
    pool, per expert) so that several arms dispatching the same `experts` sort them once.
    """
    N, K = experts.shape
    P, E = spec.ranks, spec.n_experts
    if N % P:
        raise ValueError(f"{N} tokens cannot be split into {P} ranks")
    if spec.name == "dropless":
        return DispatchResult(torch.ones_like(experts, dtype=torch.bool), 0, 0)
    dev = experts.device
    T = N // P
    El = E // P
    e = experts.reshape(-1).long()
    a = torch.arange(N * K, device=dev)
    sender = a // (T * K)
    caps = capacities(spec, T, K)

    if spec.name == "fixed_all_to_all":
        # Per (sender, global expert) cell; token order inside the cell.
        r = _cached(cache, f"cell{P}", lambda: rank_within_group(sender * E + e))
        keep = r < caps["cell"]
        dropped = int((~keep).sum())
        return DispatchResult(keep.view(N, K), dropped, 0)

    if spec.name == "pooled_wave":
        W = spec.waves
        dest = e // El
        # token-order rank in the (sender, destination) pool
        r = _cached(cache, f"pool{P}", lambda: rank_within_group(sender * P + dest))
        wave, slot = r % W, r // W
        sent = slot < caps["sender_slots"]
        keep = torch.zeros_like(sent)
        sent_idx = sent.nonzero().squeeze(1)
        # Receiver, per (wave, expert): slot-major, interleaved across sources (#8347).
        rr = rank_within_group((wave * E + e)[sent_idx], (slot * P + sender)[sent_idx])
        keep[sent_idx] = rr < caps["receiver"]
        s_drop = int((~sent).sum())
        r_drop = int(sent_idx.numel() - keep.sum())
        return DispatchResult(keep.view(N, K), s_drop, r_drop)

    if spec.name == "ragged":
        chunks = caps["chunks"]
        local = e % El
        dest = e // El
        chunk = local // (El // chunks)
        # Within a (destination, chunk): local-expert index first, then sender, then token order;
        # the flat index a is already sender-major then token order.
        r = rank_within_group(dest * chunks + chunk, local * (N * K) + a)
        keep = r < caps["chunk"]
        return DispatchResult(keep.view(N, K), int((~keep).sum()), 0)

    # waterfilling (marin_ep)
    C = caps["expert"]
    n = torch.bincount(e, minlength=E)
    over = (n - C).clamp(min=0).view(P, El)
    slack = (C - n).clamp(min=0).view(P, El).sum(1, keepdim=True)
    cum = over.cumsum(1)
    grant = torch.minimum(cum, slack) - torch.minimum(cum - over, slack)
    kept = torch.minimum(n, torch.full_like(n, C)) + grant.reshape(-1)
    # Sender s takes clip(kept_e - sum_{s'<s} n_{s',e}, 0, n_{s,e}) in token order <=> global rank < kept_e.
    keep = _cached(cache, "expert", lambda: rank_within_group(e)) < kept[e]
    return DispatchResult(keep.view(N, K), int((~keep).sum()), 0)
