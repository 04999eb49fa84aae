"""CLI: `python -m workloads.moe <stage> --config FILE --out DIR [--set KEY=VALUE ...] [--json]`.

Stages: data, tokenize, pretrain, midtrain, posttrain, eval, repro. The config schema is documented
in workloads/moe/config.py; example configs for the `tiny` scale are in workloads/moe/examples/.
Bad input (config, missing or too-small inputs) prints one line `error: ...` to stderr and exits 2
before any compute; every stage writes OUT/metrics.json and resumes from OUT when restarted. A stage
ends with one line on stdout: its headline figures for people, or with `--json` every scalar metric
as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from .config import STAGES, WorkloadError, load_config, validate
from .util import Preempted

#: The stages that may run as several tasks of one job (data-parallel training, workloads.moe.distributed).
TRAINING_STAGES = ("pretrain", "midtrain", "posttrain")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other bad input
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="python -m workloads.moe", description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--config", required=True, help="YAML or JSON stage config")
    ap.add_argument("--out", required=True, help="output directory (also the resume point)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key (dotted, value read as YAML), e.g. --set seed=1; repeatable",
    )
    ap.add_argument(
        "--json",
        action="store_true",
        help="end with the stage's metrics as one JSON object on stdout (for scripts) instead of a line for people",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        cfg = load_config(args.config, args.set)
        validate(cfg, args.stage)
        tasks = int(os.environ.get("WORLD_SIZE") or 1)
        if tasks > 1 and args.stage not in TRAINING_STAGES:
            raise WorkloadError(
                f"stage {args.stage} runs as one task, and this job started {tasks}: give it one task "
                f"(only {', '.join(TRAINING_STAGES)} train data-parallel over several)"
            )
        out.mkdir(parents=True, exist_ok=True)
        if args.stage == "data":
            from .data import run_data

            res = run_data(cfg, out)
        elif args.stage == "tokenize":
            from .tokenizing import run_tokenize

            res = run_tokenize(cfg, out)
        elif args.stage in TRAINING_STAGES:
            from .train import run_train

            res = run_train(cfg, out, args.stage)
        elif args.stage == "eval":
            from .train import run_eval

            res = run_eval(cfg, out)
        else:
            from .repro import run_repro

            res = run_repro(cfg, out)
    except WorkloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Preempted as exc:  # a scheduler stopped the job: progress is saved, the stage is not done
        print(f"{args.stage}: {exc}", file=sys.stderr)
        return exc.exit_code
    if int(os.environ.get("RANK") or 0) == 0:  # one summary line per job, from the task that wrote the results
        if args.json:
            brief = {k: v for k, v in res.items() if isinstance(v, int | float | str) and "layer_" not in k}
            print(json.dumps(brief, sort_keys=True))
        else:
            print(summary_line(res, out))
    return 0


def _split_figures(res: dict[str, Any], prefix: str, unit: str) -> list[str]:
    """``code 180,312 train + 20,114 held out`` per domain, from ``<prefix>/<domain>/<split>_<unit>`` keys."""
    found: dict[str, dict[str, Any]] = {}
    for key, value in res.items():
        match = re.fullmatch(rf"{prefix}/([^/]+)/(train|heldout)_{unit}", key)
        if match:
            found.setdefault(match[1], {})[match[2]] = value
    return [f"{d} {v.get('train', 0):,} train + {v.get('heldout', 0):,} held out" for d, v in found.items()]


def summary_line(res: dict[str, Any], out: Path) -> str:
    """The stage's result in one line for people: this is what the job's log (a Prefect task run's,
    a Slurm job's) ends with, so it names the headline figures and where the rest is, instead of
    printing all forty metrics; ``--json`` prints them all as one JSON object for scripts."""
    parts: list[str] = []
    if "steps" in res:
        parts.append(f"step {res.get('step', res['steps'])}/{res['steps']}")
    if res.get("resumed_from_step") is not None:
        parts.append(f"resumed from step {res['resumed_from_step']}")
    tokens = res.get("tokens_seen", res.get("eval/tokens_seen"))
    if isinstance(tokens, int):
        parts.append(f"{tokens:,} tokens seen")
    if isinstance(res.get("train/loss"), float):
        parts.append(f"loss {res['train/loss']:.4f}")
    if isinstance(res.get("moe/drop_fraction"), float):
        parts.append(f"drop {res['moe/drop_fraction']:.2%}")
    evals = {k.split("/")[1]: v for k, v in res.items() if re.fullmatch(r"eval/[^/]+/loss", k)}
    if evals:
        parts.append("eval loss " + ", ".join(f"{d} {v:.4f}" for d, v in evals.items()))
    if isinstance(res.get("eval/moe/drop_fraction"), float):
        parts.append(f"eval drop {res['eval/moe/drop_fraction']:.2%}")
    if bytes_ := _split_figures(res, "data", "bytes"):
        parts.append("bytes: " + "; ".join(bytes_))
    if tokens_ := _split_figures(res, "tokenize", "tokens"):
        parts.append("tokens: " + "; ".join(tokens_))
    repro = res.get("repro")
    if isinstance(repro, dict) and repro:
        drops = ", ".join(f"{arm} {v['late_median_drop']:.2%}" for arm, v in repro.items() if "late_median_drop" in v)
        parts.append(f"late-window median drop: {drops}")
    if res.get("wandb_run_id"):
        parts.append(f"W&B run {res['wandb_run_id']}")
    parts.append(f"all metrics in {out / 'metrics.json'}")
    return "done: " + " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
