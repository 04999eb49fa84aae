"""AdamW for the training stages: torch's own update, without ``torch.optim.Optimizer`` around it.

Why not ``torch.optim.AdamW``: every ``torch.optim.Optimizer`` method (``add_param_group``, already in
its constructor) is wrapped to keep TorchDynamo off, and that wrapper imports TorchDynamo on its first
call: about 3 s of CPU at the start of every training job (twice the time the tiny replica's training
takes), for a compiler these programs never use. The arithmetic here is the function torch's class
calls (``torch.optim.adamw.adamw``) with the same arguments, and :meth:`AdamW.state_dict` is torch's
layout, so the weights are bitwise those of ``torch.optim.AdamW``, checkpoints written by either load
in the other, and a checkpoint from before this module resumes as it would have
(``tests/workloads/test_optim.py`` holds all three to that).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw

#: torch.optim.AdamW's group keys besides ``params`` and the hyperparameters given here, as it saves them
_TORCH_GROUP_FLAGS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


class AdamW:
    """Decoupled-weight-decay Adam over parameter groups (``{"params": [...], "weight_decay": ...}``).

    The part of ``torch.optim.Optimizer`` the training loop uses: ``param_groups`` (whose ``"lr"`` the
    loop sets each step), :meth:`zero_grad`, :meth:`step`, :meth:`state_dict`, :meth:`load_state_dict`.
    """

    def __init__(
        self,
        groups: Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        defaults = {"weight_decay": weight_decay, "lr": lr, "betas": betas, "eps": eps, **_TORCH_GROUP_FLAGS}
        self.param_groups: list[dict[str, Any]] = []
        for group in groups:
            given = {k: v for k, v in group.items() if k != "params"}
            self.param_groups.append({**defaults, **given, "params": list(group["params"])})
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self) -> None:
        """Drops the gradients (torch's default, ``set_to_none=True``: the next backward writes fresh ones)."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.get(p)
                if state is None:  # as torch lays it out: a float32 step counter on the CPU, moments like p
                    state = self.state[p] = {
                        "step": torch.tensor(0.0, dtype=torch.float32),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            adamw(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                foreach=group["foreach"],
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: parameters numbered in group order, state keyed by number."""
        index: dict[torch.Tensor, int] = {}
        groups = []
        for group in self.param_groups:
            numbers = [index.setdefault(p, len(index)) for p in group["params"]]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
        state = {index[p]: dict(s) for p, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Moments and hyperparameters from :meth:`state_dict` (or ``torch.optim.AdamW.state_dict()``)."""
        if len(saved["param_groups"]) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved["param_groups"], self.param_groups, strict=True)
        ):
            raise ValueError("optimizer state has a different number of parameter groups or parameters")
        by_number: dict[int, torch.Tensor] = {}
        for saved_group, group in zip(saved["param_groups"], self.param_groups, strict=True):
            by_number.update(zip(saved_group["params"], group["params"], strict=True))
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        self.state = {}
        for number, s in saved["state"].items():
            p = by_number[int(number)]
            self.state[p] = {
                "step": s["step"].detach().to(torch.float32).cpu().clone(),
                "exp_avg": s["exp_avg"].detach().to(dtype=p.dtype, device=p.device).clone(),
                "exp_avg_sq": s["exp_avg_sq"].detach().to(dtype=p.dtype, device=p.device).clone(),
            }
