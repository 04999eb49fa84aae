"""Data parallelism over the tasks of a multi-task job (``srun`` tasks, one process each).

A training stage run as N tasks (the launcher sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK: torch.distributed's ``env://``) trains one model: every task draws the same global
batch from the step's seed and keeps its own contiguous block of whole sequences, gradients are
averaged across tasks before the optimizer step, and so is the quantile-balancing estimate (Marin's
TOPK estimator is already a mean over ranks, so averaging the tasks' means of equal rank counts is
the same estimate; the HIST one becomes a mean of per-task quantiles). Parameters therefore stay
identical on every task. Only task 0 writes: checkpoints, metrics, the W&B run. A stop signal is
agreed on at every step, so all tasks stop at the same step and the checkpoint task 0 saves is the
one they all resume from. The logged routing and drop metrics are the global batch's: task 0 gathers
every task's per-layer counts and sums them (metrics.combine). The LM loss is the global batch's
mean over its unmasked tokens: in post-training, where prompt tokens are masked out, tasks hold
different numbers of them, so each task's loss is weighted by its share before gradients are
averaged (a plain average of per-task means would weight the tokens of a task with few of them up).
The auxiliary balancing loss, when enabled, takes its expert fractions f_e from the global batch's
counts (summed over tasks in the forward pass), so with the averaged gradients it is one process's
loss; the z-loss is a token mean, which averaging already makes global.

One process (WORLD_SIZE unset or 1) is the plain path: nothing here does anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from .config import WorkloadError
from .metrics import LayerStats, combine


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the job's tasks (rank 0 of 1 when it is alone)."""

    rank: int = 0
    world: int = 1
    #: Where the small tensors of this process's collectives live: NCCL takes only CUDA tensors.
    device: str = "cpu"

    @classmethod
    def from_env(cls, device: torch.device, batch_size: int, ranks: int) -> DataParallel:
        """Join the job's process group when the launcher started several tasks; check the batch
        splits into whole sequences per task and whole simulated EP ranks per task, before any compute."""
        world = int(os.environ.get("WORLD_SIZE") or 1)
        if world <= 1:
            return cls()
        if batch_size % world or (batch_size // world) % ranks:
            raise WorkloadError(
                f"train.batch_size={batch_size} over {world} tasks must give each task a whole multiple of "
                f"moe.ranks={ranks} sequences; use a batch size that is a multiple of {world * ranks}"
            )
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK") or 0))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), "cuda" if device.type == "cuda" else "cpu")

    @property
    def main(self) -> bool:
        """Whether this task writes (checkpoints, metrics, the W&B run)."""
        return self.rank == 0

    def shard(self, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This task's contiguous block of whole sequences of each tensor of the global batch."""
        if self.world == 1:
            return batch
        n = batch[0].shape[0] // self.world
        return tuple(t[self.rank * n : (self.rank + 1) * n] for t in batch)

    def loss_weight(self, targets: torch.Tensor) -> float:
        """This task's share of the global batch's loss tokens times the task count: scaling this
        task's mean loss by it before gradients are averaged gives the global token mean (1.0 when
        every task holds as many loss tokens, as in pre-training)."""
        if self.world == 1:
            return 1.0
        import torch.distributed as dist

        n = float((targets != -100).sum())
        total = torch.tensor([n], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        if not float(total):
            return 1.0
        return n * self.world / float(total)

    def sum_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Per-expert counts summed over the tasks (a new tensor; every task must call it in step)."""
        import torch.distributed as dist

        total = counts.clone()
        dist.all_reduce(total)
        return total

    def global_stats(self, layers: list[LayerStats]) -> list[LayerStats]:
        """Task 0 gets every layer's statistics over the global batch; other tasks get their own
        (they log nothing). Every task must call this at the same step."""
        if self.world == 1:
            return layers
        import torch.distributed as dist

        gathered: list[list[LayerStats]] | None = [[] for _ in range(self.world)] if self.main else None
        dist.gather_object(layers, gathered, dst=0)
        if gathered is None:
            return layers
        return [combine(list(parts)) for parts in zip(*gathered, strict=True)]

    def average_gradients(self, model: torch.nn.Module) -> None:
        """Every parameter's gradient becomes the mean over tasks (the global batch's gradient)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        grads = []
        for p in model.parameters():
            if p.requires_grad:
                if p.grad is None:  # an expert no token of this task reached
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per tensor
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def average_routing_balance(self, model: Any) -> None:
        """The quantile-balancing estimate each MoE layer will apply, averaged over tasks."""
        if self.world == 1:
            return
        import torch.distributed as dist

        for layer in model.moe_layers():
            if bool(layer.qb_has_pending):
                dist.all_reduce(layer.qb_pending)
                layer.qb_pending /= self.world

    def agree(self, values: tuple[float, ...], stop: bool) -> tuple[tuple[float, ...], bool]:
        """The mean over tasks of each value, and whether any task was told to stop."""
        if self.world == 1:
            return values, stop
        import torch.distributed as dist

        t = torch.tensor([*values, 1.0 if stop else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        means = t.cpu().tolist()
        return tuple(v / self.world for v in means[:-1]), means[-1] > 0

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
