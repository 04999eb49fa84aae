"""Metric definitions (marin-moe.md section 3) against hand-computed values, and the QB update."""

from __future__ import annotations

import math

import pytest
import torch

from workloads.moe.config import ModelConfig
from workloads.moe.dispatch import DispatchSpec
from workloads.moe.metrics import (
    LayerStats,
    combine,
    load_balancing_loss,
    max_load_ratio,
    router_z_loss,
    routing_entropy,
    routing_hist,
    summarize,
)
from workloads.moe.model import MoEFeedForward, RoutingRuntime, hist_quantile_from_top


def test_drop_fractions_and_overflow_rates() -> None:
    layers = [LayerStats(counts=[3, 1], sender_dropped=1), LayerStats(counts=[2, 2], receiver_dropped=1)]
    m = summarize(layers)
    assert m["moe/drop_fraction"] == 2 / 8
    assert m["moe/sender_drop_fraction"] == 1 / 8
    assert m["moe/receiver_drop_fraction"] == 1 / 8
    assert m["moe/receiver_drop_fraction_of_received"] == 1 / 7
    assert m["train/router/capacity_overflow_rate_mean"] == (1 / 4 + 1 / 4) / 2
    assert m["train/router/layer_1/capacity_overflow_rate"] == 1 / 4
    assert m["layer_0/routing_hist"]["counts"] == [3, 1]


def test_combined_layer_statistics_are_those_of_the_batches_routed_together() -> None:
    """Two tasks' batches, one layer (E=2, K=1): task A routes 2 tokens with softmax rows [.9,.1] and
    [.6,.4], both to expert 0; task B routes 1 token, softmax [.2,.8], to expert 1."""
    logits_a = torch.log(torch.tensor([[0.9, 0.1], [0.6, 0.4]]))
    logits_b = torch.log(torch.tensor([[0.2, 0.8]]))
    whole = torch.cat([logits_a, logits_b])

    def stats(logits: torch.Tensor, counts: list[int], dropped: int) -> LayerStats:
        return LayerStats(
            counts=counts,
            sender_dropped=dropped,
            entropy=float(routing_entropy(torch.tensor(counts))),
            load_balancing_loss=float(load_balancing_loss(torch.tensor(counts), logits, 1)),
            router_z_loss=float(router_z_loss(logits)),
            tokens=logits.shape[0],
            p_mean=torch.softmax(logits, -1).mean(0).tolist(),
        )

    both = combine([stats(logits_a, [2, 0], 1), stats(logits_b, [0, 1], 0)])
    assert both.counts == [2, 1] and both.sender_dropped == 1 and both.tokens == 3
    assert both.p_mean == pytest.approx([(0.9 + 0.6 + 0.2) / 3, (0.1 + 0.4 + 0.8) / 3])
    # E * sum_e f_e * p_e = 2 * (2/3 * 1.7/3 + 1/3 * 1.3/3); not the mean of the two tasks' losses.
    assert both.load_balancing_loss == pytest.approx(2 * (2 / 3 * 1.7 / 3 + 1 / 3 * 1.3 / 3))
    assert both.load_balancing_loss == pytest.approx(float(load_balancing_loss(torch.tensor([2, 1]), whole, 1)))
    assert both.router_z_loss == pytest.approx(float(router_z_loss(whole)))
    assert both.entropy == pytest.approx(float(routing_entropy(torch.tensor([2, 1]))))
    assert summarize([both])["moe/drop_fraction"] == 1 / 3


def test_entropy_lbl_zloss_hist() -> None:
    ent = float(routing_entropy(torch.tensor([3, 1])))
    assert math.isclose(ent, -(0.75 * math.log(0.75 + 1e-6) + 0.25 * math.log(0.25 + 1e-6)), rel_tol=1e-9)
    # Uniform routing gives K: E=2, K=1, f = [.5, .5], softmax(0) = [.5, .5] -> 2 * (.25 + .25) = 1.
    assert math.isclose(float(load_balancing_loss(torch.tensor([1, 1]), torch.zeros(5, 2), 1)), 1.0)
    # Skewed: counts [3,1], K=1, logits give softmax [0.9, 0.1] -> 2 * (0.75*0.9 + 0.25*0.1) = 1.4
    logits = torch.log(torch.tensor([[0.9, 0.1]]))
    assert math.isclose(float(load_balancing_loss(torch.tensor([3, 1]), logits, 1)), 1.4, rel_tol=1e-6)
    assert math.isclose(float(router_z_loss(torch.zeros(3, 2))), math.log(2) ** 2, rel_tol=1e-6)
    h = routing_hist([0, 3, 1])
    assert (h["min"], h["max"], h["num"], h["sum"], h["sum_squares"]) == (1.0, 2.0, 4.0, 5.0, 7.0)


@pytest.mark.parametrize("estimator", ["topk", "hist"])
def test_qb_update_drives_skewed_router_towards_balance(estimator: str) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=10, d_model=16, n_heads=2, n_experts=8, top_k=2, expert_hidden=8, n_shared=0)
    layer = MoEFeedForward(cfg)
    with torch.no_grad():
        layer.router.weight[0] += 4.0  # expert 0 wins for most inputs
        layer.router.weight[1] += 1.0
    rt = RoutingRuntime(DispatchSpec("dropless", 4, 8), qb_estimator=estimator)
    x = torch.randn(4096, 16)
    ratios = []
    for _ in range(8):
        layer(x, rt)
        ratios.append(max_load_ratio(layer.last_stats.counts))
        layer.apply_pending_qb()
    assert ratios[0] > 1.8  # skewed at the start (uniform = 1.0)
    assert ratios[-1] < 1.15, ratios
    assert abs(float(layer.qb_bias.mean())) < 1e-5  # b = -(beta - mean beta) is centred


def test_in_model_metrics_match_the_definitions() -> None:
    torch.manual_seed(1)
    cfg = ModelConfig(
        vocab_size=10, d_model=16, n_heads=2, n_experts=6, top_k=2, expert_hidden=8, n_shared=1, shared_hidden=8
    )
    layer = MoEFeedForward(cfg).eval()
    x = torch.randn(64, 16)
    layer(x, RoutingRuntime(DispatchSpec("fixed_all_to_all", 2, 6, 1.0)))
    st = layer.last_stats
    s = (x @ layer.router.weight.T).detach()  # reference values only: no graph
    counts = torch.tensor(st.counts)
    assert sum(st.counts) == 64 * 2
    assert math.isclose(st.load_balancing_loss, load_balancing_loss(counts, s, 2).item(), rel_tol=1e-5)
    assert math.isclose(st.router_z_loss, router_z_loss(s).item(), rel_tol=1e-5)
    assert math.isclose(st.entropy, routing_entropy(counts).item(), rel_tol=1e-6)


def test_hist_estimator_reads_the_rank_from_the_top_by_hand() -> None:
    # Global [0.5, 3.5] in 3 bins of width 1: [0.5,1.5) [1.5,2.5) [2.5,3.5]; both columns share it.
    m = torch.tensor([[0.5, 0.5], [1.5, 0.5], [2.5, 0.5], [3.5, 3.5]])
    # column 0 counts [1, 1, 2]: rank 1 is half-way into the top bin (its 2 elements spread evenly)
    # column 1 counts [3, 0, 1]: rank 1 is the top bin's lower edge
    assert hist_quantile_from_top(m, 1.0, 3).tolist() == [3.0, 2.5]
    # rank 3 in column 0: 2 above bin 1, all of bin 1 needed -> its lower edge; rank 2.5 -> its middle
    assert hist_quantile_from_top(m, 3.0, 3)[0].item() == 1.5
    assert hist_quantile_from_top(m, 2.5, 3)[0].item() == 2.0
    # rank 4 in column 1: its 3 elements at 0.5 fill bin 0 -> its lower edge
    assert hist_quantile_from_top(m, 4.0, 3)[1].item() == 0.5


def test_hist_estimator_matches_the_exact_global_quantile_within_a_bin() -> None:
    torch.manual_seed(3)
    m = torch.randn(20_000, 5) * torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0]) + torch.arange(5.0)
    rank = 20_000 * 2 / 5
    exact = torch.sort(m, dim=0, descending=True).values[int(rank) - 1]
    width = float(m.max() - m.min()) / 10_000
    assert torch.allclose(hist_quantile_from_top(m, rank, 10_000), exact, atol=2 * width)
