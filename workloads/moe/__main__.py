"""CLI: `python -m workloads.moe <stage> --config FILE --out DIR [--set KEY=VALUE ...]`.

Stages: data, tokenize, pretrain, midtrain, posttrain, eval, repro. The config schema is documented
in workloads/moe/config.py; example configs for the `tiny` scale are in workloads/moe/examples/.
Bad input (config, missing or too-small inputs) prints one line `error: ...` to stderr and exits 2
before any compute; every stage writes OUT/metrics.json and resumes from OUT when restarted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

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
        brief = {k: v for k, v in res.items() if isinstance(v, int | float | str) and "layer_" not in k}
        print(json.dumps(brief, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
