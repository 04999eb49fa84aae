"""Decoder-only MoE language model with Marin's grug routing (marin-moe.md section 1).

Routing, per layer:
  s = x W_r in fp32; selection = top-(K+1) of s + stopgrad(b); alpha_t = the (K+1)-th biased score;
  weights = sigmoid(s) on the *unbiased* logits of the K chosen experts, rescaled to sum to 2.5;
  y = sum_{kept k} w_k Expert_k(x) + Shared(x). A dropped assignment contributes 0 (no renormalization).
Quantile balancing (QB, TOPK estimator): margins m = s - alpha; on each rank beta_e is the q-th largest
margin, q = max(1, floor(T*K/E)); ranks are averaged; the *next* step uses b <- -(beta - mean beta).
The bias is a buffer (not a parameter): it only moves selection and never receives gradients.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .dispatch import DispatchSpec, dispatch
from .metrics import LayerStats, load_balancing_loss, router_z_loss, routing_entropy

#: The batched expert path pads every expert to the busiest one's load; beyond this many padded rows
#: per real assignment (a routing collapse: one expert takes most tokens) the per-expert loop is used,
#: so memory stays within twice the gathered activations.
GROUPED_MAX_PADDING = 2


@dataclass
class RoutingRuntime:
    """Per-forward knobs that are not architecture: dispatch, EP degree, what to record."""

    spec: DispatchSpec
    qb: bool = True
    qb_estimator: str = "topk"  # "topk" | "hist" (see MoEFeedForward._qb_beta)
    qb_hist_bins: int = 10000
    collect_metrics: bool = True
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    record_routing: bool = False  # keep per-layer expert ids (repro measurement arms)
    #: Sums per-expert counts over a data-parallel job's tasks (distributed.DataParallel): the
    #: balancing loss's f_e is then the global batch's, as one process computes it. Training only.
    sum_counts: Callable[[torch.Tensor], torch.Tensor] | None = None


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def rope_tables(seq: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, ...]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def hist_quantile_from_top(m: torch.Tensor, rank: float, bins: int) -> torch.Tensor:
    """Per column e of m [N, E]: the value with `rank` elements of the column above it, read off a
    histogram (Marin's HIST QB estimator, marin-moe.md section 1).

    Every column is binned over the same global [min, max] into `bins` equal bins; counting from
    the top bin down, the bin where the running count reaches `rank` is found and the value is
    interpolated linearly inside it, as if its elements were spread evenly. On a real EP group the
    per-expert histograms are summed over devices before this read; here all tokens are in one
    process, so the sum is the histogram of all of them.
    """
    N, E = m.shape
    lo, hi = float(m.min()), float(m.max())
    width = (hi - lo) / bins
    if width <= 0:  # every margin equal
        return m.new_full((E,), lo)
    b = ((m - lo) / width).long().clamp_(0, bins - 1)
    counts = torch.bincount((b + torch.arange(E, device=m.device) * bins).reshape(-1), minlength=E * bins)
    counts = counts.view(E, bins).to(torch.float64)
    from_top = counts.flip(1).cumsum(1).flip(1)  # from_top[e, j] = elements in bins j..bins-1
    target = min(max(rank, 0.0), float(N))
    # the highest bin whose count-from-top reaches the target (bin 0 always does: its count is N)
    j = (from_top >= target).to(torch.int64).cumsum(1).argmax(1)
    above = torch.where(j + 1 < bins, from_top.gather(1, (j + 1).clamp(max=bins - 1)[:, None])[:, 0], 0.0)
    inside = counts.gather(1, j[:, None])[:, 0]
    frac = ((target - above) / inside.clamp(min=1.0)).clamp(0.0, 1.0)
    upper = lo + (j + 1).to(torch.float64) * width
    return (upper - frac * width).to(m.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.h = cfg.n_heads
        self.window = cfg.attn_window
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.o = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.window and self.window < S:
            i = torch.arange(S, device=x.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, S, D))


class MoEFeedForward(nn.Module):
    """Routed SwiGLU experts + always-on shared SwiGLU experts, with QB-biased selection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, E, H = cfg.d_model, cfg.n_experts, cfg.expert_hidden
        self.E, self.K, self.weight_sum = E, cfg.top_k, cfg.routed_weight_sum
        self.router = nn.Linear(D, E, bias=False)
        std = 1.0 / math.sqrt(D)
        self.w1 = nn.Parameter(torch.randn(E, D, H) * std)
        self.w3 = nn.Parameter(torch.randn(E, D, H) * std)
        self.w2 = nn.Parameter(torch.randn(E, H, D) / math.sqrt(H))
        self.shared = SwiGLU(D, cfg.n_shared * cfg.shared_hidden) if cfg.n_shared else None
        self.register_buffer("qb_bias", torch.zeros(E))
        self.register_buffer("qb_pending", torch.zeros(E))
        self.register_buffer("qb_has_pending", torch.zeros((), dtype=torch.bool))
        self.last_stats: LayerStats | None = None
        self.last_experts: torch.Tensor | None = None
        self.last_aux: torch.Tensor | None = None
        self.metrics_time_s = 0.0
        self.grouped_max_padding: float = GROUPED_MAX_PADDING  # 0: always the per-expert loop

    @torch.no_grad()
    def apply_pending_qb(self) -> None:
        """b <- -(beta - mean beta), the beta measured in the previous forward (a fixed-point step)."""
        if bool(self.qb_has_pending):
            self.qb_bias.copy_(-(self.qb_pending - self.qb_pending.mean()))
            self.qb_has_pending.fill_(False)

    @torch.no_grad()
    def _qb_beta(self, s: torch.Tensor, alpha: torch.Tensor, rt: RoutingRuntime) -> torch.Tensor:
        """beta_e: the margin m = s - alpha above which about N*K/E tokens would pick expert e.

        TOPK (Marin's model default): per rank the q-th largest margin of each expert, q =
        max(1, floor(T*K/E)), averaged over ranks. HIST (the hero's): one global histogram per
        expert, read at the same rank (see `hist_quantile_from_top`).
        """
        N = s.shape[0]
        m = s - alpha[:, None]
        if rt.qb_estimator == "hist":
            return hist_quantile_from_top(m, N * self.K / self.E, rt.qb_hist_bins)
        ranks = rt.spec.ranks
        T = N // ranks
        q = max(1, (T * self.K) // self.E)
        beta = torch.kthvalue(m.view(ranks, T, self.E), T - q + 1, dim=1).values  # q-th largest
        return beta.mean(0)

    def _experts(
        self, x: torch.Tensor, experts: torch.Tensor, w: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor:
        """sum over kept assignments of w * Expert(x) (dropped ones contribute 0), plus shared experts."""
        N = x.shape[0]
        flat_e = experts.reshape(-1)
        flat_w = w.reshape(-1).to(x.dtype)
        tok = torch.arange(N, device=x.device).repeat_interleave(self.K)
        if keep is not None:
            kept = keep.reshape(-1)
            flat_e, flat_w, tok = flat_e[kept], flat_w[kept], tok[kept]
        order = torch.argsort(flat_e, stable=True)
        e_sorted, tok_sorted = flat_e[order], tok[order]
        counts = torch.bincount(e_sorted, minlength=self.E)
        xs = x[tok_sorted]
        y = torch.zeros_like(x)
        n = e_sorted.numel()
        if n:
            widest = int(counts.max())  # the one host read of the step's expert loads
            if widest * self.E <= self.grouped_max_padding * n:
                out = self._grouped(xs, e_sorted, counts, widest)
            else:
                out = self._looped(xs, counts.tolist())
            y = y.index_add(0, tok_sorted, out * flat_w[order, None])
        if self.shared is not None:
            y = y + self.shared(x)
        return y

    def _grouped(self, xs: torch.Tensor, e_sorted: torch.Tensor, counts: torch.Tensor, widest: int) -> torch.Tensor:
        """All experts in three batched matmuls over [E, widest, D], zero-padded per expert.

        A Python loop of three matmuls per expert costs 3E kernel launches a layer, which bounds
        the step on a GPU (and costs on a CPU too). The padding rows are computed and thrown away:
        only real rows are gathered back, so they reach neither the output nor any gradient.
        """
        n = e_sorted.numel()
        start = torch.cumsum(counts, 0) - counts
        slot = torch.arange(n, device=xs.device) - start[e_sorted]
        padded = xs.new_zeros(self.E, widest, xs.shape[1])
        padded = padded.index_put((e_sorted, slot), xs)
        h = F.silu(torch.bmm(padded, self.w1)) * torch.bmm(padded, self.w3)
        return torch.bmm(h, self.w2)[e_sorted, slot]

    def _looped(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One expert at a time over its contiguous rows: for loads too uneven to pad (a collapse)."""
        outs = []
        start = 0
        for e, c in enumerate(counts):  # a loop over experts, never over tokens
            if c:
                h = xs[start : start + c]
                outs.append((F.silu(h @ self.w1[e]) * (h @ self.w3[e])) @ self.w2[e])
                start += c
        return torch.cat(outs)

    def forward(self, x: torch.Tensor, rt: RoutingRuntime, compute: bool = True) -> torch.Tensor:
        """Route, dispatch, record; with compute=False stop before the experts (routing only)."""
        N, D = x.shape
        s = F.linear(x.float(), self.router.weight.float())  # fp32 logits
        top_vals, top_idx = torch.topk(s.detach() + self.qb_bias, self.K + 1, dim=-1)
        experts = top_idx[:, : self.K]
        alpha = top_vals[:, self.K]
        w = torch.sigmoid(s.gather(1, experts))
        w = w * (self.weight_sum / w.sum(-1, keepdim=True))
        if self.training and rt.qb:
            self.qb_pending.copy_(self._qb_beta(s.detach(), alpha, rt))
            self.qb_has_pending.fill_(True)

        res = dispatch(experts, rt.spec)
        y = self._experts(x, experts, w, res.keep if rt.spec.name != "dropless" else None) if compute else x

        c_all = torch.bincount(experts.reshape(-1), minlength=self.E)
        aux = s.new_zeros(())
        if rt.aux_loss_coef:
            # f_e from the global batch when tasks share it; the softmax mean stays this task's, and
            # averaging gradients over tasks (equal token counts) makes it the global mean too
            c_loss = rt.sum_counts(c_all) if rt.sum_counts is not None and self.training else c_all
            aux = aux + rt.aux_loss_coef * load_balancing_loss(c_loss, s, self.K)
        if rt.z_loss_coef:
            aux = aux + rt.z_loss_coef * router_z_loss(s)
        self.last_aux = aux
        self.last_experts = experts.detach() if rt.record_routing else None
        if rt.collect_metrics:
            t_metrics = time.perf_counter()
            with torch.no_grad():
                # One logsumexp pass feeds both the z-loss and the softmax mean of the balancing
                # statistic (same definitions as metrics.py, half the passes over [N, E]).
                sd = s.detach()
                lse = torch.logsumexp(sd, dim=-1)
                p_mean = torch.exp(sd - lse[:, None]).mean(0)
                f = c_all.to(sd.dtype) / max(1, N * self.K)
                vals = torch.cat(
                    [
                        torch.stack(
                            [
                                self.E * (self.K * f * p_mean).sum(),
                                lse.pow(2).mean(),
                                routing_entropy(c_all).to(sd.dtype),
                            ]
                        ),
                        p_mean,
                    ]
                ).tolist()  # one device-to-host copy
                self.last_stats = LayerStats(
                    counts=c_all.tolist(),
                    sender_dropped=res.sender_dropped,
                    receiver_dropped=res.receiver_dropped,
                    entropy=vals[2],
                    load_balancing_loss=vals[0],
                    router_z_loss=vals[1],
                    tokens=N,
                    p_mean=vals[3:],
                )
            self.metrics_time_s += time.perf_counter() - t_metrics  # for the benchmark's cost report
        else:
            self.last_stats = None
        return y


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, dense_hidden: int = 0) -> None:
        super().__init__()
        self.n1 = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.n2 = nn.RMSNorm(cfg.d_model)
        self.ffn: nn.Module = SwiGLU(cfg.d_model, dense_hidden) if dense_hidden else MoEFeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rt: RoutingRuntime) -> torch.Tensor:
        x = x + self.attn(self.n1(x), cos, sin)
        h = self.n2(x)
        if isinstance(self.ffn, MoEFeedForward):
            f = self.ffn(h.reshape(-1, h.shape[-1]), rt).view_as(h)
        else:
            f = self.ffn(h)
        return x + f


class MoELM(nn.Module):
    """The language model. `dense=True` swaps every MoE block for a SwiGLU with the same active width
    (K*expert_hidden + n_shared*shared_hidden), which is the benchmark's baseline."""

    def __init__(self, cfg: ModelConfig, dense: bool = False) -> None:
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("model.vocab_size must be set (from the tokenizer) before building the model")
        self.cfg = cfg
        dense_hidden = cfg.top_k * cfg.expert_hidden + cfg.n_shared * cfg.shared_hidden if dense else 0
        self.emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, dense_hidden) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.emb.weight, std=0.02)
        nn.init.normal_(self.head.weight, std=0.02)

    def moe_layers(self) -> list[MoEFeedForward]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoEFeedForward)]

    def apply_pending_qb(self) -> None:
        for m in self.moe_layers():
            m.apply_pending_qb()

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor,
        rt: RoutingRuntime,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (total loss incl. aux terms, LM loss). targets == -100 are masked out of the loss."""
        B, S = idx.shape
        if B % rt.spec.ranks:
            raise ValueError(f"batch of {B} sequences cannot be split into {rt.spec.ranks} ranks")
        cos, sin = rope_tables(S, self.cfg.d_model // self.cfg.n_heads, self.cfg.rope_theta, idx.device)
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x, cos, sin, rt)
        logits = self.head(self.norm(x)).float()
        lm = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        aux = sum((m.last_aux for m in self.moe_layers() if m.last_aux is not None), lm.new_zeros(()))
        return lm + aux, lm

    def route(self, idx: torch.Tensor, rt: RoutingRuntime) -> None:
        """Run the blocks (routing, dispatch, QB beta in train mode) without the LM head or a loss.

        The measurement pass of the repro stage: every layer's routing and stats are recorded as in
        `forward`, and drops under `rt.spec` change the hidden states of later layers exactly as there.
        """
        B, S = idx.shape
        if B % rt.spec.ranks:
            raise ValueError(f"batch of {B} sequences cannot be split into {rt.spec.ranks} ranks")
        cos, sin = rope_tables(S, self.cfg.d_model // self.cfg.n_heads, self.cfg.rope_theta, idx.device)
        x = self.emb(idx)
        for i, b in enumerate(self.blocks):
            if i + 1 < len(self.blocks):
                x = b(x, cos, sin, rt)
            elif isinstance(b.ffn, MoEFeedForward):  # the last layer's experts feed no later routing
                x = x + b.attn(b.n1(x), cos, sin)
                b.ffn(b.n2(x).reshape(-1, x.shape[-1]), rt, compute=False)

    def layer_stats(self) -> list[LayerStats]:
        return [m.last_stats for m in self.moe_layers() if m.last_stats is not None]

    def config_dict(self) -> dict[str, object]:
        return asdict(self.cfg)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
