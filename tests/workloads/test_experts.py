"""The expert computation: batched (zero-padded bmm) and per-expert loop agree with a per-token reference.

The batched path is what every stage runs; the loop is its fallback when one expert's load is too
uneven to pad (a routing collapse). Both must give y_t = sum over kept k of w_tk * Expert_e(x_t) plus
the shared experts, with dropped assignments contributing nothing, and the same gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workloads.moe.config import ModelConfig
from workloads.moe.model import MoEFeedForward

E, K, N, D = 8, 2, 48, 16


def _layer() -> MoEFeedForward:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=64,
        d_model=D,
        n_layers=1,
        n_heads=2,
        context=32,
        n_experts=E,
        top_k=K,
        expert_hidden=8,
        n_shared=1,
        shared_hidden=8,
    )
    return MoEFeedForward(cfg).double()


def _reference(
    ff: MoEFeedForward, x: torch.Tensor, experts: torch.Tensor, w: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    rows = []
    for t in range(x.shape[0]):
        y = ff.shared(x[t : t + 1])[0]
        for k in range(K):
            if keep[t, k]:
                e = int(experts[t, k])
                y = y + w[t, k] * (F.silu(x[t] @ ff.w1[e]) * (x[t] @ ff.w3[e])) @ ff.w2[e]
        rows.append(y)
    return torch.stack(rows)


def _routing(collapsed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    first = torch.zeros(N, dtype=torch.long) if collapsed else torch.randint(0, E, (N,), generator=g)
    second = (first + 1 + torch.randint(0, E - 1, (N,), generator=g)) % E  # distinct from the first
    experts = torch.stack([first, second], 1)
    w = torch.rand(N, K, generator=g, dtype=torch.float64)
    keep = torch.rand(N, K, generator=g) > 0.25
    return experts, w, keep


@pytest.mark.parametrize("collapsed", [False, True], ids=["spread", "collapsed"])
@pytest.mark.parametrize("padding", [2, 0], ids=["batched", "loop"])
def test_expert_paths_match_the_per_token_definition(collapsed: bool, padding: float) -> None:
    ff = _layer()
    ff.grouped_max_padding = padding
    experts, w, keep = _routing(collapsed)
    x = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)

    y = ff._experts(x, experts, w, keep)
    y.square().sum().backward()
    got = [y.detach(), x.grad.clone(), ff.w1.grad.clone(), ff.w2.grad.clone(), ff.w3.grad.clone()]

    ff.zero_grad()
    x.grad = None
    want_y = _reference(ff, x, experts, w, keep)
    want_y.square().sum().backward()
    want = [want_y.detach(), x.grad, ff.w1.grad, ff.w2.grad, ff.w3.grad]
    for name, a, b in zip(("y", "dx", "dw1", "dw2", "dw3"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_a_collapse_is_not_padded_to_the_busiest_expert() -> None:
    """One expert with every token would pad E x N rows: the loop takes it, the padded buffer is never made."""
    ff = _layer()
    experts, w, keep = _routing(collapsed=True)
    made: list[tuple[int, ...]] = []
    real_grouped = ff._grouped

    def spy(*args: object) -> torch.Tensor:
        made.append(tuple(args[0].shape))  # type: ignore[attr-defined]
        return real_grouped(*args)  # type: ignore[arg-type]

    ff._grouped = spy  # type: ignore[method-assign]
    ff._experts(torch.randn(N, D, dtype=torch.float64), experts, w, keep)
    assert made == []
    spread, w2, keep2 = _routing(collapsed=False)
    ff._experts(torch.randn(N, D, dtype=torch.float64), spread, w2, keep2)
    assert len(made) == 1
