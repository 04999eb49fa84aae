"""Each dispatch scheme against drop counts computed by hand from marin-moe.md section 2."""

from __future__ import annotations

import pytest
import torch

from workloads.moe.dispatch import DispatchSpec, capacities, dispatch, rank_within_group


def _ids(rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows).view(-1, 1)  # K = 1: assignment index == token index


def _kept(res) -> list[int]:
    return [int(i) for i in res.keep.view(-1).nonzero().view(-1)]


def test_rank_within_group_breaks_ties_by_position() -> None:
    g = torch.tensor([1, 0, 1, 0, 1])
    assert rank_within_group(g).tolist() == [0, 0, 1, 1, 2]
    order = torch.tensor([5, 1, 0, 1, 0])  # ties in `order` (1,1) and (0,0) fall back to position
    assert rank_within_group(g, order).tolist() == [2, 0, 0, 1, 1]


def test_fixed_all_to_all_cells_keep_first_tokens() -> None:
    # P=2, E=2, T=4, K=1: A=4, C = ceil(1.0*4/2) = 2 per (sender, expert) cell.
    spec = DispatchSpec("fixed_all_to_all", ranks=2, n_experts=2, capacity_factor=1.0)
    assert capacities(spec, 4, 1)["cell"] == 2
    res = dispatch(_ids([0, 0, 0, 1, 1, 1, 1, 1]), spec)
    assert _kept(res) == [0, 1, 3, 4, 5]  # token 2 (3rd to e0 on rank 0), tokens 6,7 on rank 1
    assert (res.sender_dropped, res.receiver_dropped) == (3, 0)
    # cf 1.0625 -> C = ceil(2.125) = 3: only rank 1's fourth assignment drops.
    res = dispatch(_ids([0, 0, 0, 1, 1, 1, 1, 1]), DispatchSpec("fixed_all_to_all", 2, 2, 1.0625))
    assert _kept(res) == [0, 1, 2, 3, 4, 5, 6]


def test_fixed_all_to_all_with_top_k_uses_flat_assignment_order() -> None:
    # P=1, E=3, T=2, K=2: A=4, C = ceil(4/3) = 2. Expert 0 is chosen by both tokens' both... ties:
    experts = torch.tensor([[0, 1], [0, 1], [1, 0]])  # T=3 -> A=6, C=2; e1 demand 3, e0 demand 3
    res = dispatch(experts, DispatchSpec("fixed_all_to_all", 1, 3, 1.0))
    # flat order a = t*K+k: e0 at a=0,2,5; e1 at a=1,3,4 -> drop a=5 (e0) and a=4 (e1)
    assert res.keep.view(-1).tolist() == [True, True, True, True, False, False]


def test_pooled_wave_sender_gate_and_slot_major_receiver() -> None:
    # P=2, E=2 (E_l=1), W=2, T=6, K=1: A=6, V=12.
    # sender slots S = ceil(1.0*6/(2*2)) = 2; receiver R = clip(ceil(0.6*12/4), 1, ceil(0.6*6/2)) = 2.
    spec = DispatchSpec("pooled_wave", 2, 2, capacity_factor=0.6, transport_capacity_factor=1.0, waves=2)
    caps = capacities(spec, 6, 1)
    assert (caps["sender_slots"], caps["receiver"]) == (2, 2)
    res = dispatch(_ids([0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1]), spec)
    # rank 0 -> dest 0: r=0..4, waves 0,1,0,1,0, slots 0,0,1,1,2: token 4 dropped at the sender.
    # expert 0 wave 0 receives t0(s0,src0) t2(s1,src0) t6(s0,src1) t8(s1,src1); slot-major keeps t0,t6
    # (source-major would keep t0,t2). wave 1: t1 t7 (slot 0) before t3 (slot 1) -> t3 drops.
    # expert 1 wave 0: t5 t9 (slot 0) before t11 (slot 1) -> t11 drops; wave 1: t10 kept.
    assert _kept(res) == [0, 1, 5, 6, 7, 9, 10]
    assert (res.sender_dropped, res.receiver_dropped) == (1, 4)


def test_ragged_fills_chunk_by_local_expert_then_sender_then_token() -> None:
    # P=1, E=4 (E_l=4, 2 chunks of 2 experts), T=6, K=1: C = clip(ceil(0.5*6), 4, max(4, 3)) = 4,
    # chunk capacity max(2, ceil(4/2)) = 2. Chunk 0 = experts 0,1: expert 0's tokens (1, 3) win.
    spec = DispatchSpec("ragged", 1, 4, capacity_factor=0.5, chunks=2)
    assert capacities(spec, 6, 1)["chunk"] == 2
    res = dispatch(_ids([1, 0, 1, 0, 2, 3]), spec)
    assert _kept(res) == [1, 3, 4, 5]
    assert (res.sender_dropped, res.receiver_dropped) == (2, 0)


def test_ragged_first_sender_wins() -> None:
    # P=2, E=2 (E_l=1 is odd -> 1 chunk), T=2: C = clip(ceil(0.5*4/2), 1, 1) = 1 per rank.
    res = dispatch(_ids([0, 0, 0, 1]), DispatchSpec("ragged", 2, 2, capacity_factor=0.5))
    assert _kept(res) == [0, 3]
    assert res.sender_dropped == 2


def test_waterfilling_grants_group_slack_in_expert_order() -> None:
    # P=1, E=3, T=6: C = ceil(0.5*1*6/3) = 1. n = [3, 3, 0]: overflow [2, 2, 0], slack 1
    # -> grant [1, 0, 0], kept [2, 1, 0]. Expert 0 keeps tokens 0,2; expert 1 keeps token 1.
    spec = DispatchSpec("waterfilling", 1, 3, capacity_factor=0.5)
    res = dispatch(_ids([0, 1, 0, 1, 0, 1]), spec)
    assert _kept(res) == [0, 1, 2]
    assert res.sender_dropped == 3


def test_waterfilling_sender_prefix_across_ranks() -> None:
    # P=2, E=4 (E_l=2), T=4: C = ceil(1.0*2*4/4) = 2. n = [4,1,1,2]; group 0 slack 1 -> kept_0 = 3.
    # Expert 0: rank 0 sends t0,t1,t2 first (sender-major), so rank 1's t4 is the one dropped.
    res = dispatch(_ids([0, 0, 0, 1, 0, 2, 3, 3]), DispatchSpec("waterfilling", 2, 4, 1.0))
    assert _kept(res) == [0, 1, 2, 3, 5, 6, 7]
    assert (res.sender_dropped, res.receiver_dropped) == (1, 0)


def test_dropless_keeps_everything() -> None:
    res = dispatch(torch.randint(0, 8, (16, 2)), DispatchSpec("dropless", 4, 8))
    assert bool(res.keep.all()) and res.dropped == 0


@pytest.mark.parametrize("name", ["fixed_all_to_all", "ragged", "waterfilling"])
def test_balanced_routing_with_headroom_drops_nothing(name: str) -> None:
    # Every rank sends exactly A/E to every expert: with cf = tcf = 1.5 nothing may drop.
    P, E, T = 2, 4, 8
    experts = torch.arange(P * T).remainder(E).view(-1, 1)
    res = dispatch(experts, DispatchSpec(name, P, E, capacity_factor=1.5, transport_capacity_factor=1.5, waves=2))
    assert res.dropped == 0


def test_pooled_wave_stripes_alias_with_a_periodic_expert_pattern() -> None:
    # Same balanced table, W=2: in each (sender, destination) pool the experts alternate 0,1,0,1, so
    # wave = r mod 2 puts *every* assignment of an expert into one wave. Each expert then gets 4 in a
    # wave whose receiver capacity is ceil(1.5*16/(4*2)) = 3: one receiver drop per expert.
    experts = torch.arange(16).remainder(4).view(-1, 1)
    res = dispatch(experts, DispatchSpec("pooled_wave", 2, 4, 1.5, 1.5, waves=2))
    assert (res.sender_dropped, res.receiver_dropped) == (0, 4)
    assert _kept(res) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # slot 1 of source 1 loses each time


def test_unknown_dispatch_rejected() -> None:
    with pytest.raises(ValueError, match="unknown dispatch"):
        DispatchSpec("ring_magic", 2, 4)


def test_rank_within_group_large_ids_take_the_general_path() -> None:
    # Group ids above the element count skip the bincount shortcut; both paths must agree.
    g = torch.tensor([7, 3, 7, 3, 7])
    big = g * 1000
    order = torch.tensor([2, 2, 1, 0, 1])
    assert rank_within_group(big).tolist() == rank_within_group(g).tolist() == [0, 0, 1, 1, 2]
    assert rank_within_group(big, order).tolist() == rank_within_group(g, order).tolist() == [2, 1, 0, 0, 1]


def test_pooled_wave_sender_gate_is_one_pool_of_s_times_w() -> None:
    # The waves are a fixed stripe of the (sender, destination) pool: slot = r // W < S <=> r < S*W, so
    # the sender-side unit is the whole pool (mu = A/P, capacity S*W), whatever the experts' order.
    # P=2, E=4 (E_l=2), W=3, T=12, K=1: A=12, S = ceil(1.0*12/(2*3)) = 2 -> the pool keeps 6.
    spec = DispatchSpec("pooled_wave", 2, 4, capacity_factor=4.0, transport_capacity_factor=1.0, waves=3)
    assert capacities(spec, 12, 1)["sender_slots"] == 2
    # rank 0 sends 8 to destination 0 (experts 0/1, in any mix) and 4 to destination 1; rank 1 sends
    # 12 to destination 1 (experts 2/3).
    rows = [0, 1, 1, 0, 2, 0, 3, 1, 1, 2, 0, 3] + [2, 3, 3, 3, 2, 2, 3, 2, 3, 3, 2, 2]
    res = dispatch(_ids(rows), spec)
    # rank 0 -> dest 0: tokens 0,1,2,3,5,7,8,10 (r = 0..7): r = 6, 7 (tokens 8, 10) drop.
    # rank 0 -> dest 1: tokens 4,6,9,11 (r = 0..3): all kept. rank 1 -> dest 1: r >= 6 (tokens 18..23) drop.
    assert res.sender_dropped == 2 + 6 and res.receiver_dropped == 0
    assert _kept(res) == [0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13, 14, 15, 16, 17]


def test_shared_cache_gives_the_same_result_as_separate_dispatches() -> None:
    torch.manual_seed(0)
    experts = torch.stack([torch.randperm(12)[:3] for _ in range(96)])  # P=4, E=12, K=3, T=24
    specs = [DispatchSpec("fixed_all_to_all", 4, 12, cf) for cf in (1.0, 1.1)]
    specs += [DispatchSpec("pooled_wave", 4, 12, cf, tcf) for cf, tcf in ((1.33, 1.05), (1.15, 1.15))]
    specs += [DispatchSpec("ragged", 4, 12, 1.15), DispatchSpec("waterfilling", 4, 12, 1.0)]
    cache: dict[str, torch.Tensor] = {}
    for spec in specs:
        a, b = dispatch(experts, spec), dispatch(experts, spec, cache)
        assert torch.equal(a.keep, b.keep) and (a.sender_dropped, a.receiver_dropped) == (
            b.sender_dropped,
            b.receiver_dropped,
        )
    assert set(cache) == {"cell4", "pool4", "expert"}
