"""openlab's overhead per pipeline stage, against a bare subprocess and a bare Prefect task.

Every variant runs the same job, ``true``, so the job itself costs next to nothing and
what is left is orchestration: for openlab, the stage identity, the reuse check, the
lease, the lineage writes (stage run, attempt, artifact, relations, events), the local
launcher (a supervised process group) and the output snapshot. Measured in one run:

- bare subprocess: ``subprocess.run(["true"])``;
- bare Prefect task: a ``@task`` calling ``subprocess.run(["true"])`` inside a flow
  (Prefect's ephemeral API in a temp PREFECT_HOME; skipped if it cannot start);
- openlab, executed: ``execute_stage`` with the stage forced to run;
- openlab, reused: ``execute_stage`` finding a completed identity with verified outputs.

Targets (issue 4): <= 0.3 s per executed stage and <= 50 ms per reused stage, overhead
meaning openlab's time minus the bare subprocess's. Usage::

    python benchmarks/bench_stage_overhead.py [--stages 6] [--rounds 3] [--no-prefect]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STAGE_NAMES = ["data", "tokenize", "pretrain", "midtrain", "posttrain", "eval"]


def _git(repo: Path, *args: str) -> None:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "b",
        "GIT_AUTHOR_EMAIL": "b@e",
        "GIT_COMMITTER_NAME": "b",
        "GIT_COMMITTER_EMAIL": "b@e",
    }
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, env=env)


def make_pipeline(root: Path, n: int):  # noqa: ANN201 - imported lazily below
    """A chain of ``n`` stages whose job is ``true``, each declaring its own code file."""
    from orchestrator.pipeline import Pipeline, StageSpec

    repo = root / "repo"
    (repo / "stages").mkdir(parents=True)
    names = (STAGE_NAMES * ((n // len(STAGE_NAMES)) + 1))[:n]
    names = [f"{name}{i}" for i, name in enumerate(names)]
    for name in names:
        (repo / "stages" / f"{name}.sh").write_text("true\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "bench")
    stages = []
    for i, name in enumerate(names):
        stages.append(
            StageSpec(
                name=name,
                inputs={"prev": names[i - 1]} if i else {},
                code_paths=(f"stages/{name}.sh",),
                environment_fields=("python_version",),
                command=("true",),
            )
        )
    return Pipeline(name="bench", stages=tuple(stages), repo_root=repo), {
        name: {"i": i} for i, name in enumerate(names)
    }


def bench_subprocess(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(["true"], check=True)
        out.append(time.perf_counter() - t)
    return out


def bench_prefect(n: int) -> list[float] | str:
    """Per-task wall time of a bare Prefect task running ``true`` (after the flow has started)."""
    try:
        from prefect import flow, task
    except ImportError as exc:  # pragma: no cover
        return f"prefect not importable: {exc}"

    @task
    def run_true() -> int:
        return subprocess.run(["true"], check=True).returncode

    @flow(persist_result=False)
    def bench_flow(k: int) -> list[float]:
        times = []
        run_true()  # warm-up: first task pays one-off registration costs
        for _ in range(k):
            t = time.perf_counter()
            run_true()
            times.append(time.perf_counter() - t)
        return times

    try:
        return bench_flow(n)
    except Exception as exc:  # noqa: BLE001 - report, do not crash the table
        return f"prefect flow failed: {type(exc).__name__}: {exc}"


def bench_openlab(n: int, rounds: int) -> dict[str, list[float]]:
    from orchestrator.lineage.store import LineageStore
    from orchestrator.pipeline import PipelineHooks, RunOptions, execute_stage, finish_pipeline, start_pipeline
    from orchestrator.settings import load_settings

    root = Path(tempfile.mkdtemp(prefix="openlab-bench-"))
    pipeline, configs = make_pipeline(root, n)
    settings = load_settings()
    store = LineageStore.open(settings)
    results: dict[str, list[float]] = {"start": [], "executed": [], "reused": []}
    for r in range(rounds + 1):  # round 0 warms imports and caches
        for mode in ("executed", "reused"):
            options = RunOptions(force=(mode == "executed"), poll=0.02, wait_poll=0.05)
            t = time.perf_counter()
            ctx = start_pipeline(
                pipeline, configs, options=options, hooks=PipelineHooks(), settings=settings, store=store
            )
            start = time.perf_counter() - t
            per_stage = []
            for name in pipeline.order:
                t = time.perf_counter()
                res = execute_stage(ctx, name)
                per_stage.append(time.perf_counter() - t)
                expected = "COMPLETED" if mode == "executed" else "REUSED"
                assert res.state == expected, (name, res.state, res.reason)
            finish_pipeline(ctx)
            if r:
                results[mode].extend(per_stage)
                results["start"].append(start)
    store.close()
    return results


def fmt(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-prefect", action="store_true")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="openlab-bench-home-"))
    os.environ["OPENLAB_HOME"] = str(home)
    os.environ.pop("OPENLAB_DB_URL", None)
    os.environ["OPENLAB_CONFIG"] = str(home / "openlab.toml")
    (home / "openlab.toml").write_text("")
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

    n = args.stages * args.rounds
    bare = bench_subprocess(max(n, 10))
    ol = bench_openlab(args.stages, args.rounds)
    prefect = "skipped (--no-prefect)" if args.no_prefect else bench_prefect(max(n, 10))

    bare_med = statistics.median(bare)
    rows = [("bare subprocess `true`", bare_med, None, "")]
    if isinstance(prefect, list):
        rows.append(
            ("bare Prefect task running `true`", statistics.median(prefect), statistics.median(prefect) - bare_med, "")
        )
    ex = statistics.median(ol["executed"])
    re_ = statistics.median(ol["reused"])
    ex_over = ex - bare_med
    re_over = re_ - 0.0  # a reused stage runs no job at all
    rows.append(("openlab stage, executed", ex, ex_over, f"<= 300 ms: {'met' if ex_over <= 0.3 else 'MISSED'}"))
    rows.append(("openlab stage, reused", re_, re_over, f"<= 50 ms: {'met' if re_over <= 0.05 else 'MISSED'}"))
    rows.append(
        ("openlab pipeline start (once per run)", statistics.median(ol["start"]), None, "reconcile + provenance")
    )

    print(
        f"\n{args.stages} stages x {args.rounds} rounds, median per stage; python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs, SQLite lineage store\n"
    )
    print("| path | ms per stage | openlab/Prefect overhead vs bare subprocess (ms) | target |")
    print("|---|---:|---:|---|")
    for name, value, over, target in rows:
        print(f"| {name} | {fmt(value)} | {fmt(over) if over is not None else '-'} | {target} |")
    if not isinstance(prefect, list):
        print(f"\nPrefect: {prefect}")
    print(
        f"\nexecuted p90 {fmt(sorted(ol['executed'])[int(0.9 * (len(ol['executed']) - 1))])} ms, "
        f"reused p90 {fmt(sorted(ol['reused'])[int(0.9 * (len(ol['reused']) - 1))])} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
