"""The training stages' AdamW is torch.optim.AdamW's arithmetic and checkpoint layout, without TorchDynamo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workloads.moe.optim import AdamW

ROOT = Path(__file__).resolve().parents[2]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))


def _groups(model: torch.nn.Module) -> list[dict[str, object]]:
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


def _train(model: torch.nn.Module, opt: object, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        for group in opt.param_groups:  # type: ignore[attr-defined]
            group["lr"] = 1e-2 / (1 + step)  # the loop's schedule: set on the groups each step
        opt.zero_grad()  # type: ignore[attr-defined]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()  # type: ignore[attr-defined]


def _same_state(a: dict[str, object], b: dict[str, object]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()  # type: ignore[attr-defined]
    for number, moments in a["state"].items():  # type: ignore[attr-defined]
        theirs = b["state"][number]  # type: ignore[index]
        assert moments.keys() == theirs.keys()
        for key, tensor in moments.items():
            assert tensor.dtype == theirs[key].dtype and torch.equal(tensor, theirs[key]), (number, key)


def test_the_weights_and_the_saved_state_are_bitwise_torchs_adamw() -> None:
    ours, theirs = _model(), _model()
    opt = AdamW(_groups(ours), lr=1e-2, betas=(0.9, 0.95))
    ref = torch.optim.AdamW(_groups(theirs), lr=1e-2, betas=(0.9, 0.95))
    _train(ours, opt, range(7))
    _train(theirs, ref, range(7))
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q)
    _same_state(opt.state_dict(), ref.state_dict())


def test_a_checkpoint_of_either_resumes_in_the_other_as_if_never_stopped() -> None:
    """A checkpoint saved before this optimizer (torch's) resumes bitwise; one saved by it loads in torch."""
    straight = _model()
    _train(straight, AdamW(_groups(straight), lr=1e-2, betas=(0.9, 0.95)), range(6))
    for first, then in ((torch.optim.AdamW, AdamW), (AdamW, torch.optim.AdamW)):
        before = _model()
        opt = first(_groups(before), lr=1e-2, betas=(0.9, 0.95))
        _train(before, opt, range(3))
        saved = {"model": before.state_dict(), "optimizer": opt.state_dict()}
        after = _model(seed=1)  # other weights: everything comes from the checkpoint
        after.load_state_dict(saved["model"])
        resumed = then(_groups(after), lr=5.0, betas=(0.5, 0.5))  # and the hyperparameters too
        resumed.load_state_dict(saved["optimizer"])
        _train(after, resumed, range(3, 6))
        for p, q in zip(after.parameters(), straight.parameters(), strict=True):
            assert torch.equal(p, q), (first.__module__, then.__module__)


def test_a_state_of_another_model_is_refused() -> None:
    opt = AdamW(_groups(_model()), lr=1e-2)
    other = torch.nn.Linear(2, 2)
    saved = torch.optim.AdamW([{"params": [other.weight]}], lr=1e-2).state_dict()
    with pytest.raises(ValueError, match="different number of parameter groups or parameters"):
        opt.load_state_dict(saved)


def test_a_training_step_does_not_import_torchdynamo() -> None:
    """The point of the module: a training job does not spend seconds importing a compiler it never runs."""
    code = (
        "import sys, torch\n"
        "from workloads.moe.optim import AdamW\n"
        "m = torch.nn.Linear(3, 3)\n"
        "opt = AdamW([{'params': list(m.parameters())}], lr=0.1)\n"
        "m(torch.ones(1, 3)).sum().backward()\n"
        "torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)\n"
        "opt.step(); opt.zero_grad(); opt.load_state_dict(opt.state_dict())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
