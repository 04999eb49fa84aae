"""Data parallelism over the tasks of a multi-task job (``srun`` tasks, one process each).

A training stage run as N tasks (the launcher sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK: torch.distributed's ``env://``) trains one model: every task draws the same global
batch from the step's seed and keeps its own contiguous block of whole sequences, gradients are
averaged across tasks before the optimizer step, and so is the quantile-balancing estimate (Marin's
TOPK estimator is already a mean over ranks, so averaging the tasks' means of equal rank counts is
the same estimate; the HIST one becomes a mean of per-task quantiles). Parameters therefore stay
identical on every task. Only task 0 writes: checkpoints, metrics, the W&B run. A stop signal is
agreed on at every step, so all tasks stop at the same step and the checkpoint task 0 saves is the
one they all resume from. Routing and drop metrics are task 0's share of the batch. In post-training,
where prompt tokens are masked out of the loss, each task's loss is a mean over its own unmasked
tokens, so the average over tasks weights them slightly differently from one process's mean.

One process (WORLD_SIZE unset or 1) is the plain path: nothing here does anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from .config import WorkloadError


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the job's tasks (rank 0 of 1 when it is alone)."""

    rank: int = 0
    world: int = 1

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
        return cls(dist.get_rank(), dist.get_world_size())

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

    def agree(self, loss: float, stop: bool) -> tuple[float, bool]:
        """The mean of the tasks' losses, and whether any task was told to stop."""
        if self.world == 1:
            return loss, stop
        import torch.distributed as dist

        t = torch.tensor([loss, 1.0 if stop else 0.0], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t[0]) / self.world, bool(t[1] > 0)

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
