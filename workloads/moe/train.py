"""Stages `pretrain`, `midtrain`, `posttrain` and `eval`: one training loop, three data sources.

- pretrain  builds the model from `model:` and trains on `train.mixture` of the token shards.
- midtrain  loads `inputs.checkpoint` (weights, QB biases, optimizer, tokens seen) and continues on a
            different mixture with its own LR schedule.
- posttrain loads `inputs.checkpoint` and fine-tunes on the SFT stream (signature -> docstring) with the
            loss masked on the prompt.
- eval      held-out loss per domain (and on the SFT set) plus routing/drop metrics.

Batches are a pure function of (seed, step), so a restarted stage sees exactly the data it would have
seen; together with the checkpointed model/optimizer/QB/RNG state this makes resume bitwise on CPU.
Checkpoints (OUT/checkpoint/state.pt) are written atomically every `train.checkpoint_every` steps.
With `train.keep_every: N`, every N-th step's checkpoint is also kept as an immutable revision,
OUT/checkpoint/revisions/step-NNNNNN.pt, listed with its step and tokens seen in
OUT/checkpoint/revisions.json: the checkpoint before a loss spike, or at a given token count, stays
loadable (`inputs.checkpoint` takes the file) and part of the stage's recorded output.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import Config, ConfigError, ModelConfig, WorkloadError
from .dispatch import DispatchSpec
from .distributed import DataParallel
from .metrics import summarize
from .model import MoELM, RoutingRuntime, count_params
from .optim import AdamW
from .tokenizing import load_manifest, open_shard
from .tracking import SilentTracker, open_tracker
from .util import Preempted, StopSignals, atomic_torch_save, atomic_write_text, pick_device, setup_torch

CKPT = "checkpoint/state.pt"
REVISIONS = "checkpoint/revisions"
REVISIONS_INDEX = "checkpoint/revisions.json"


# --------------------------------------------------------------------------- data


class TokenData:
    """Memmapped shards of a `tokenize` output; batches are sampled deterministically per step."""

    def __init__(self, tokens_dir: Path) -> None:
        self.dir = tokens_dir
        self.manifest = load_manifest(tokens_dir)
        dt = str(self.manifest["dtype"])
        self.shards: dict[tuple[str, str], np.ndarray] = {}
        for d, splits in self.manifest["shards"].items():  # type: ignore[union-attr]
            for s, info in splits.items():
                self.shards[(d, s)] = open_shard(tokens_dir, info["path"], dt)
        self.sft: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for s, info in self.manifest.get("sft", {}).items():  # type: ignore[union-attr]
            self.sft[s] = (open_shard(tokens_dir, info["ids"], dt), open_shard(tokens_dir, info["mask"], "uint8"))
        self.vocab_size = int(self.manifest["vocab_size"])  # type: ignore[arg-type]

    @property
    def domains(self) -> list[str]:
        return sorted({d for d, _ in self.shards})

    def check(self, mixture: dict[str, float], context: int, split: str, sft: bool = False) -> None:
        """Fail before compute if a domain is unknown or a shard is shorter than one context window."""
        if sft:
            n = self.sft[split][0].size if split in self.sft else 0
            if n < context + 1:
                raise WorkloadError(f"model.context={context} is longer than the SFT {split} stream ({n} tokens)")
            return
        for d in mixture:
            if (d, split) not in self.shards:
                raise ConfigError(f"config: train.mixture names domain '{d}' not in the tokens ({self.domains})")
            n = self.shards[(d, split)].size
            if n < context + 1:
                raise ConfigError(
                    f"config: model.context={context} is longer than the data: domain '{d}' {split} split "
                    f"has {n} tokens"
                )

    def batch(
        self, rng: np.random.Generator, n: int, context: int, mixture: dict[str, float], split: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        names = sorted(mixture)
        p = np.array([mixture[k] for k in names], dtype=np.float64)
        doms = rng.choice(len(names), size=n, p=p / p.sum())
        rows = []
        for di in doms:
            arr = self.shards[(names[di], split)]
            o = int(rng.integers(0, arr.size - context))
            rows.append(np.asarray(arr[o : o + context + 1], dtype=np.int64))
        t = torch.from_numpy(np.stack(rows))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def distinct_batch(
        self, rng: np.random.Generator, n: int, context: int, mixture: dict[str, float], split: str
    ) -> torch.Tensor:
        """n whole windows of `context` tokens that never overlap one another (a measurement batch).

        Each sequence's domain is drawn from `mixture` as in `batch`; within a domain the windows are
        distinct slots of a grid with stride `context` and a random shift, so no two sequences of the
        batch share a token (random offsets would make sequences on different ranks share content).
        """
        names = sorted(mixture)
        p = np.array([mixture[k] for k in names], dtype=np.float64)
        doms = rng.choice(len(names), size=n, p=p / p.sum())
        rows: list[np.ndarray] = [np.empty(0)] * n
        for di, name in enumerate(names):
            where = np.flatnonzero(doms == di)
            if not where.size:
                continue
            arr = self.shards[(name, split)]
            slots = arr.size // context
            if slots < where.size:
                raise WorkloadError(
                    f"domain '{name}' {split} split holds {slots} distinct windows of {context} tokens; "
                    f"a measurement batch needs {where.size}"
                )
            shift = int(rng.integers(0, arr.size - slots * context + 1))
            picks = rng.choice(slots, size=where.size, replace=False)
            for i, s in zip(where, picks, strict=True):
                o = shift + int(s) * context
                rows[i] = np.asarray(arr[o : o + context], dtype=np.int64)
        return torch.from_numpy(np.stack(rows))

    def sft_batch(self, rng: np.random.Generator, n: int, context: int, split: str) -> tuple[torch.Tensor, ...]:
        ids, mask = self.sft[split]
        xs, ys = [], []
        for _ in range(n):
            o = int(rng.integers(0, ids.size - context))
            w = np.asarray(ids[o : o + context + 1], dtype=np.int64)
            m = np.asarray(mask[o + 1 : o + context + 1], dtype=bool)
            y = w[1:].copy()
            y[~m] = -100  # loss only on response tokens
            xs.append(w[:-1])
            ys.append(y)
        return torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))


def step_rng(seed: int, step: int, salt: int) -> np.random.Generator:
    return np.random.default_rng([seed, step, salt])


# --------------------------------------------------------------------------- checkpoints


def resolve_checkpoint(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / CKPT if (p / CKPT).is_file() else p / "state.pt"
    if not p.is_file():
        raise WorkloadError(f"inputs.checkpoint: no checkpoint at {path} (expected DIR/{CKPT})")
    return p


def load_state(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def model_config_from(state: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**state["model_config"])


def check_model_section(cfg: Config, mc: ModelConfig) -> None:
    """A `model:` section in a checkpoint-loading stage must agree with the checkpoint."""
    if "model" not in cfg.given:
        return
    for f in dataclasses.fields(ModelConfig):
        want, have = getattr(cfg.model, f.name), getattr(mc, f.name)
        if f.name == "vocab_size" and want == 0:
            continue
        if want != have:
            raise ConfigError(f"config: model.{f.name}={want} disagrees with the input checkpoint ({have})")


def save_checkpoint(
    out: Path,
    model: MoELM,
    opt: AdamW,
    step: int,
    tokens_seen: int,
    stage: str,
    cfg: Config,
    lineage: dict[str, Any],
) -> None:
    state = {
        "model_config": dataclasses.asdict(model.cfg),
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": step,
        "tokens_seen": tokens_seen,
        "stage": stage,
        # the stage's config as it decides the weights: its W&B section (this run's ids, its commit) left
        # out, or no two runs of one stage identity wrote the same checkpoint and every later stage ran again
        "config": {k: v for k, v in cfg.to_dict().items() if k != "wandb"},
        "qb_bias": [m.qb_bias.tolist() for m in model.moe_layers()],
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "lineage": lineage,
    }
    atomic_torch_save(state, out / CKPT)
    atomic_write_text(
        out / "checkpoint/meta.json",
        json.dumps(
            {
                "step": step,
                "tokens_seen": tokens_seen,
                "stage": stage,
                "model_config": state["model_config"],
                "lineage": lineage,
            },
            indent=2,
        ),
    )


def keep_revision(out: Path, step: int, tokens_seen: int) -> None:
    """Keep the checkpoint just saved as ``revisions/step-NNNNNN.pt`` and list it with its tokens seen.

    A hard link: the next save replaces ``state.pt`` with a new file, so the revision keeps these
    bytes and costs no copy (a copy where the filesystem has no links). Idempotent, so a resumed
    run that finds the revision of the step it resumes from made already changes nothing.
    """
    name = f"step-{step:06d}.pt"
    target = out / REVISIONS / name
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{name}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(out / CKPT, tmp)
        except OSError:
            shutil.copyfile(out / CKPT, tmp)
        os.replace(tmp, target)
    index = out / REVISIONS_INDEX
    listed = [r for r in (json.loads(index.read_text()) if index.is_file() else []) if r["step"] != step]
    listed.append({"step": step, "tokens_seen": tokens_seen, "file": f"revisions/{name}"})
    atomic_write_text(index, json.dumps(sorted(listed, key=lambda r: r["step"]), indent=2))


def make_optimizer(model: MoELM, cfg: Config) -> AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return AdamW(
        [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.train.lr,
        betas=(0.9, 0.95),
    )


def lr_at(step: int, cfg: Config) -> float:
    tc = cfg.train
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    frac = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def runtime(
    cfg: Config, mc: ModelConfig, collect: bool = True, spec: DispatchSpec | None = None, record_routing: bool = False
) -> RoutingRuntime:
    """The routing settings of `moe:` as the model reads them; `spec` replaces the dispatch (repro trains
    with one arm's), so every `moe:` option reaches every stage from this one place."""
    mo = cfg.moe
    if spec is None:
        spec = DispatchSpec(
            mo.dispatch, mo.ranks, mc.n_experts, mo.capacity_factor, mo.transport_capacity_factor, mo.waves, mo.chunks
        )
    return RoutingRuntime(
        spec,
        qb=mo.qb,
        qb_estimator=mo.qb_estimator,
        qb_hist_bins=mo.qb_hist_bins,
        collect_metrics=collect,
        aux_loss_coef=mo.aux_loss_coef,
        z_loss_coef=mo.z_loss_coef,
        record_routing=record_routing,
    )


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop lines logged after the checkpoint we resume from (they will be logged again)."""
    if not path.is_file():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= last_step]
    atomic_write_text(path, "".join(ln + "\n" for ln in keep))


# --------------------------------------------------------------------------- the loop


def prepare(cfg: Config, stage: str) -> tuple[TokenData, ModelConfig, dict[str, Any] | None, dict[str, Any]]:
    """Everything that can fail on bad input, before any model is built."""
    data = TokenData(Path(cfg.inputs.tokens or ""))
    init_state = None
    lineage: dict[str, Any] = {"tokens": str(cfg.inputs.tokens), "tokens_fingerprint": data.manifest["fingerprint"]}
    if stage in ("midtrain", "posttrain", "eval"):
        ck = resolve_checkpoint(cfg.inputs.checkpoint or "")
        init_state = load_state(ck)
        mc = model_config_from(init_state)
        check_model_section(cfg, mc)
        lineage["checkpoint"] = str(ck)
        lineage["parent_tokens_seen"] = init_state["tokens_seen"]
    else:
        mc = dataclasses.replace(cfg.model)
        if mc.vocab_size and mc.vocab_size != data.vocab_size:
            raise ConfigError(f"config: model.vocab_size={mc.vocab_size} but the tokenizer has {data.vocab_size}")
        mc.vocab_size = data.vocab_size
    if mc.n_experts % cfg.moe.ranks:
        raise ConfigError(f"config: model.n_experts={mc.n_experts} is not divisible by moe.ranks={cfg.moe.ranks}")
    return data, mc, init_state, lineage


def mixture_of(cfg: Config, data: TokenData) -> dict[str, float]:
    return dict(cfg.train.mixture) if cfg.train.mixture else {d: 1.0 for d in data.domains}


def run_train(cfg: Config, out: Path, stage: str) -> dict[str, Any]:
    setup_torch(cfg.threads)
    data, mc, init_state, lineage = prepare(cfg, stage)
    sft = stage == "posttrain"
    mixture = mixture_of(cfg, data)
    data.check(mixture, mc.context, "train", sft=sft)
    data.check(mixture, mc.context, "heldout", sft=sft)
    device = pick_device(cfg.device)
    dp = DataParallel.from_env(device, cfg.train.batch_size, cfg.moe.ranks)
    try:
        return _train(cfg, out, stage, data, mc, init_state, lineage, sft, mixture, device, dp)
    finally:
        dp.close()


def _train(
    cfg: Config,
    out: Path,
    stage: str,
    data: TokenData,
    mc: ModelConfig,
    init_state: dict[str, Any] | None,
    lineage: dict[str, Any],
    sft: bool,
    mixture: dict[str, float],
    device: torch.device,
    dp: DataParallel,
) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    # Python's own generator too: nothing here draws from it, but a checkpoint keeps its state for a
    # resume, and left to the OS's entropy it made every checkpoint of one config differ in those bytes,
    # so a forced re-run never let the stages after it be reused
    random.seed(cfg.seed)
    model = MoELM(mc).to(device)
    opt = make_optimizer(model, cfg)
    start, tokens_seen = 0, 0
    resume = (out / CKPT).is_file()
    if resume:
        st = load_state(out / CKPT)
        if st["model_config"] != dataclasses.asdict(mc):
            raise WorkloadError(f"{out / CKPT}: checkpoint's model differs from this config; use a fresh --out")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        start, tokens_seen = int(st["step"]), int(st["tokens_seen"])
        torch.set_rng_state(st["rng"]["torch"])
        random.setstate(st["rng"]["python"])
        keep = cfg.train.keep_every
        if dp.main and keep and start % keep == 0:  # stopped between the save and its revision
            keep_revision(out, start, tokens_seen)
    elif init_state is not None:
        model.load_state_dict(init_state["model"])
        try:
            opt.load_state_dict(init_state["optimizer"])  # continue Adam moments across stages
        except (ValueError, KeyError):
            pass
        tokens_seen = int(init_state["tokens_seen"])
    if dp.main:
        truncate_jsonl(out / "metrics.jsonl", start)

    rt = runtime(cfg, mc)
    if dp.world > 1:
        rt.sum_counts = dp.sum_counts
    n_params = count_params(model)
    summary: dict[str, Any] = {"stage": stage, "params": n_params, "resumed_from_step": start if resume else None}
    if dp.world > 1:
        summary["tasks"] = dp.world
    cfg_dict = cfg.to_dict()
    tracker = open_tracker(out, stage, cfg_dict, cfg.wandb, total_steps=cfg.train.steps) if dp.main else SilentTracker()
    with StopSignals() as signals, tracker as tr:
        model.train()
        t_last = time.perf_counter()
        for step in range(start, cfg.train.steps):
            rng = step_rng(cfg.seed, step, 1)
            if sft:
                x, y = data.sft_batch(rng, cfg.train.batch_size, mc.context, "train")
            else:
                x, y = data.batch(rng, cfg.train.batch_size, mc.context, mixture, "train")
            tokens_seen += int(x.numel())  # the global batch's
            x, y = dp.shard(x, y)
            x, y = x.to(device), y.to(device)
            lr = lr_at(step, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            loss, lm = model(x, y, rt)
            share = dp.loss_weight(y)
            if share != 1.0:  # the global batch's token mean once gradients are averaged over tasks
                loss = loss + (share - 1.0) * lm
            opt.zero_grad()
            loss.backward()
            dp.average_gradients(model)
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            opt.step()
            dp.average_routing_balance(model)
            model.apply_pending_qb()
            (train_loss, total_loss), told_to_stop = dp.agree(
                (share * float(lm.detach()), float(loss.detach())), signals.signum is not None
            )
            now = time.perf_counter()
            m: dict[str, Any] = {
                "train/loss": train_loss,
                "train/total_loss": total_loss,
                "train/lr": lr,
                "train/grad_norm": float(gnorm),
                "train/tokens_seen": tokens_seen,
                "train/step_time_s": now - t_last,
            }
            t_last = now
            m.update(summarize(dp.global_stats(model.layer_stats())))
            tr.log(m, step + 1)
            done = step + 1 == cfg.train.steps
            stop = cfg.train.stop_after and step + 1 == cfg.train.stop_after
            signalled = told_to_stop and not done  # every task stops at the same step
            kept = bool(cfg.train.keep_every) and (step + 1) % cfg.train.keep_every == 0
            if (step + 1) % cfg.train.checkpoint_every == 0 or done or stop or signalled or kept:
                if dp.main:
                    save_checkpoint(out, model, opt, step + 1, tokens_seen, stage, cfg, lineage)
                    if kept:
                        keep_revision(out, step + 1, tokens_seen)
                dp.barrier()  # no task goes on (or resumes) before the checkpoint is whole
            if signalled:
                raise Preempted(signals.signum or signal.SIGTERM, step + 1)
            if stop and not done:
                summary.update({"stopped_after": step + 1})
                if dp.main:
                    atomic_write_text(out / "metrics.json", json.dumps(summary, indent=2))
                return summary
        if not dp.main:  # task 0 measures the held-out loss and writes the results
            return summary
        last = _last_logged(out / "metrics.jsonl")
        summary.update({k: v for k, v in last.items() if not isinstance(v, dict)})
        summary["steps"] = cfg.train.steps
        summary["tokens_seen"] = tokens_seen
        summary.update(heldout_metrics(model, data, cfg, mc, device, sft=sft, batches=2))
        if (out / REVISIONS_INDEX).is_file():
            summary["checkpoint_revisions"] = len(json.loads((out / REVISIONS_INDEX).read_text()))
        summary["wandb_run_id"] = tr.run_id
        tr.summary(summary)
    atomic_write_text(out / "metrics.json", json.dumps(summary, indent=2))
    return summary


def _last_logged(path: Path) -> dict[str, Any]:
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
    return json.loads(lines[-1]) if lines else {}


@torch.no_grad()
def heldout_metrics(
    model: MoELM, data: TokenData, cfg: Config, mc: ModelConfig, device: torch.device, sft: bool, batches: int
) -> dict[str, Any]:
    """Held-out LM loss per domain (and SFT loss) + routing metrics over all held-out batches."""
    was = model.training
    model.eval()
    rt = runtime(cfg, mc)
    out: dict[str, Any] = {}
    stats_all = []
    bs = cfg.eval.batch_size
    targets = [] if sft else [d for d in data.domains if data.shards[(d, "heldout")].size > mc.context]
    for d in targets:
        losses = []
        for b in range(batches):
            x, y = data.batch(step_rng(cfg.seed, b, 2), bs, mc.context, {d: 1.0}, "heldout")
            _, lm = model(x.to(device), y.to(device), rt)
            losses.append(float(lm))
            stats_all.append(model.layer_stats())
        out[f"eval/{d}/loss"] = sum(losses) / len(losses)
    if "heldout" in data.sft and data.sft["heldout"][0].size > mc.context:
        losses = []
        for b in range(batches):
            x, y = data.sft_batch(step_rng(cfg.seed, b, 3), bs, mc.context, "heldout")
            _, lm = model(x.to(device), y.to(device), rt)
            losses.append(float(lm))
            stats_all.append(model.layer_stats())
        out["eval/sft/loss"] = sum(losses) / len(losses)
    if stats_all:
        # Sum counts over batches layer by layer so the fractions are exact global ratios.
        merged = stats_all[0]
        for st in stats_all[1:]:
            for a, b in zip(merged, st, strict=True):
                a.counts = [i + j for i, j in zip(a.counts, b.counts, strict=True)]
                a.sender_dropped += b.sender_dropped
                a.receiver_dropped += b.receiver_dropped
        summ = summarize(merged, prefix="eval/", hist=False)
        out.update({k: v for k, v in summ.items() if "layer_" not in k})
    model.train(was)
    return out


def run_eval(cfg: Config, out: Path) -> dict[str, Any]:
    setup_torch(cfg.threads)
    data, mc, state, lineage = prepare(cfg, "eval")
    for d in data.domains:
        data.check({d: 1.0}, mc.context, "heldout")
    device = pick_device(cfg.device)
    model = MoELM(mc).to(device)
    assert state is not None
    model.load_state_dict(state["model"])
    res = heldout_metrics(model, data, cfg, mc, device, sft=False, batches=cfg.eval.batches)
    res.update({"eval/tokens_seen": int(state["tokens_seen"]), "eval/checkpoint": lineage["checkpoint"]})
    with open_tracker(out, "eval", cfg.to_dict(), cfg.wandb) as tr:
        tr.log({k: v for k, v in res.items() if isinstance(v, int | float)}, int(state["step"]))
        res["wandb_run_id"] = tr.run_id
        tr.summary(res)
    atomic_write_text(out / "metrics.json", json.dumps(res, indent=2))
    return res
