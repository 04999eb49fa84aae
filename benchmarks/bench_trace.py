"""`openlab lineage trace` on a store with many pipeline runs, against a hand-written SQL query.

What a user would otherwise do to answer "what did this checkpoint come from?" or "what was
made at this commit?" is a recursive query over the relation table (``sqlite3`` and a
``WITH RECURSIVE``), which returns ids only. ``trace`` also follows the two links that are
columns (a stage run's attempts and its pipeline run), loads every record it reaches and
builds the tree the CLI prints, so it does more; the ratio says what that costs.

The store is shaped like real pipelines (six stages, each stage run with one attempt,
an artifact it generated and the previous stage's artifact it used; commit and environment
shared by ten runs; one raw-data snapshot used by every run) and filled through the lineage
store itself, so it carries the event chain too. Usage::

    python benchmarks/bench_trace.py [--runs 300] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STAGES = ["data", "tokenize", "pretrain", "midtrain", "posttrain", "eval"]

UP_SQL = """
WITH RECURSIVE reach(id) AS (
  SELECT ? UNION SELECT r.object_id FROM relation r JOIN reach ON r.subject_id = reach.id
) SELECT count(*) FROM reach"""
DOWN_SQL = """
WITH RECURSIVE reach(id) AS (
  SELECT ? UNION SELECT r.subject_id FROM relation r JOIN reach ON r.object_id = reach.id
) SELECT count(*) FROM reach"""

AFFECTED_SQL = """
WITH RECURSIVE reach(id) AS (
  SELECT stage_run_id FROM attempt WHERE host = 'n17'
  UNION SELECT r.subject_id FROM relation r JOIN reach ON r.object_id = reach.id
) SELECT count(*) FROM reach"""


def fill(store: object, runs: int) -> dict[str, str]:
    """`runs` six-stage pipeline runs; returns the ids the queries start from."""
    from orchestrator.lineage import Artifact, Attempt, Commit, DataSnapshot, Environment, PipelineRun, StageRun

    with store.transaction() as tx:  # type: ignore[attr-defined]
        raw = tx.add(DataSnapshot(id="snap_raw", path="/data/raw", files=10, bytes=10, manifest_path="/m.json"))
    commit = env = None
    last_artifact = ""
    first_commit = ""
    for i in range(runs):
        with store.transaction() as tx:  # type: ignore[attr-defined]
            if i % 10 == 0:
                sha = f"{i:040x}"
                commit = tx.add(Commit(id=sha, sha=sha, message=f"change {i}"))
                env = tx.add(
                    Environment(id=f"env_{i:016x}", python="3.11", hostname="h", platform="linux", packages_hash="p")
                )
                first_commit = first_commit or commit.id
            run = tx.add(PipelineRun(recipe="marin", replica="small", backend="slurm", state="COMPLETED"))
            tx.relate("wasAssociatedWith", run, commit, role="code")
            tx.relate("wasAssociatedWith", run, env, role="environment")
            previous = None
            for stage in STAGES:
                srun = tx.add(StageRun(pipeline_run_id=run.id, stage=stage, identity=f"{i}-{stage}", state="COMPLETED"))
                tx.add(Attempt(stage_run_id=srun.id, backend="slurm", job_id=str(1000 + i), state="COMPLETED"))
                tx.relate("wasAssociatedWith", srun, commit, role="code")
                tx.relate("wasAssociatedWith", srun, env, role="environment")
                tx.relate("used", srun, previous if previous is not None else raw, role="input")
                out = tx.add(Artifact(name=f"{stage}-out", uri=f"/runs/{i}/{stage}", content_hash=f"{i}{stage}"))
                tx.relate("wasGeneratedBy", out, srun)
                previous = out
            last_artifact = previous.id  # type: ignore[union-attr]
    return {"checkpoint": last_artifact, "commit": first_commit}


def timed(fn: Callable[[], int], repeat: int) -> tuple[float, int]:
    times, reached = [], 0
    for _ in range(repeat):
        t = time.perf_counter()
        reached = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), reached


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=300, help="pipeline runs in the store (six stages each)")
    ap.add_argument("--repeat", type=int, default=5)
    opts = ap.parse_args()

    with tempfile.TemporaryDirectory() as home:
        os.environ["OPENLAB_HOME"] = home
        from orchestrator.lineage import LineageStore
        from orchestrator.lineage.trace import trace

        db = Path(home) / "lineage.db"
        store = LineageStore(f"sqlite:///{db}")
        t = time.perf_counter()
        start = fill(store, opts.runs)
        fill_s = time.perf_counter() - t
        conn = sqlite3.connect(db)
        records = conn.execute("SELECT (SELECT count(*) FROM relation) + (SELECT count(*) FROM stagerun)").fetchone()[0]
        print(f"store: {opts.runs} pipeline runs, {records} relations + stage runs, filled in {fill_s:.1f} s\n")

        cases = [
            ("up from the newest checkpoint", start["checkpoint"], "up", UP_SQL),
            ("down from a commit (10 runs)", start["commit"], "down", DOWN_SQL),
        ]
        print("| query | records reached, trace / SQL | `trace` (ms) | recursive SQL (ms) | trace / SQL |")
        print("|---|---|---|---|---|")
        for label, rid, direction, sql in cases:

            def walk(rid: str = rid, direction: str = direction) -> int:
                return len({n.id for n in trace(store, rid, direction=direction).walk()})  # type: ignore[arg-type]

            def recursive_sql(rid: str = rid, sql: str = sql) -> int:
                return int(conn.execute(sql, (rid,)).fetchone()[0])

            t_trace, n_trace = timed(walk, opts.repeat)
            t_sql, n_sql = timed(recursive_sql, opts.repeat)
            print(
                f"| {label} | {n_trace} / {n_sql} | {t_trace * 1e3:.1f} | {t_sql * 1e3:.2f} | {t_trace / t_sql:.0f}x |"
            )
        # `lineage affected --host`: every job of the store ran on one bad node, the worst case
        # (each stage run a source). The SQL a user would write walks down from those stage runs.
        conn.execute("UPDATE attempt SET host = 'n17'")
        conn.commit()
        from orchestrator.lineage.affected import affected
        from orchestrator.lineage.listing import RecordFilter

        def report() -> int:
            found = affected(store, RecordFilter(host="n17"))
            return len(found.made_there) + len(found.outputs) + len(found.stage_runs)

        def affected_sql() -> int:
            return int(conn.execute(AFFECTED_SQL).fetchone()[0])

        t_aff, n_aff = timed(report, opts.repeat)
        t_sql, n_sql = timed(affected_sql, opts.repeat)
        label = f"affected --host n17 ({opts.runs * len(STAGES)} jobs there)"
        print(f"| {label} | {n_aff} / {n_sql} | {t_aff * 1e3:.1f} | {t_sql * 1e3:.2f} | {t_aff / t_sql:.0f}x |")
        store.close()
        conn.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
