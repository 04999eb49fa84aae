"""`openlab job list` with many Slurm jobs out, against `squeue` (a benchmark, not a test).

A lab with hundreds of jobs pending reads `openlab job list` as it reads `squeue`: it must
not take a second per hundred jobs. ``--jobs`` held jobs (``sbatch --hold``: pending, never
running, no CPU) are recorded as attempts in a throw-away lineage store; then, in one run,
median of ``--reps``:

- **squeue**: ``squeue -h -j ID,ID,...``, what a Slurm user would type.
- **openlab job list**: ``openlab job list --json``, the whole command (Python start, lineage
  read, the backend asked, the rows written back), and the same command with no job out: what
  any ``openlab`` command costs before it does anything.
- **statuses, one call**: ``SlurmLauncher.statuses`` (one ``squeue`` for all of them), in process.
- **one status per job**: the same handles asked one ``scontrol show job`` each, what
  ``job list`` did before (``Launcher.statuses``, the default every backend has).

Needs the Slurm cluster ``make services-up`` starts (``SLURM_CONF`` from its services.env).

    python benchmarks/bench_job_list.py [--jobs 200] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=200, help="held Slurm jobs out at once")
    ap.add_argument("--reps", type=int, default=5)
    opts = ap.parse_args()
    if not shutil.which("squeue"):
        print("error: squeue not found: run `make services-up` and source its services.env", file=sys.stderr)
        return 2

    home = Path(tempfile.mkdtemp(prefix="bench-job-list-"))
    os.environ["OPENLAB_HOME"] = str(home)
    from orchestrator.launchers import get_launcher
    from orchestrator.launchers.attempts import handle_from_attempt
    from orchestrator.launchers.base import Launcher
    from orchestrator.lineage.models import Attempt
    from orchestrator.lineage.store import open_store

    launcher = get_launcher("slurm")
    job_ids: list[str] = []
    try:
        for _ in range(opts.jobs):
            out = subprocess.run(
                ["sbatch", "--parsable", "--hold", "--output=/dev/null", "--wrap", "true"],
                capture_output=True,
                text=True,
                check=True,
            )
            job_ids.append(out.stdout.strip().split(";")[0])
        with open_store() as store, store.transaction() as tx:
            attempts = [
                tx.add(Attempt(backend="slurm", cluster=launcher.cluster, job_id=job_id, state="PENDING"))
                for job_id in job_ids
            ]
        handles = [handle_from_attempt(a, launcher) for a in attempts]
        openlab = [sys.executable, "-m", "orchestrator.cli.main", "job", "list", "--json"]
        listed = subprocess.run(openlab, capture_output=True, text=True, check=False)
        if listed.returncode != 0 or listed.stdout.count('"state": "PENDING"') != opts.jobs:
            print(f"error: `openlab job list` did not list {opts.jobs} pending jobs: {listed.stderr}", file=sys.stderr)
            return 1

        squeue = median_seconds(
            lambda: subprocess.run(["squeue", "-h", "-j", ",".join(job_ids)], capture_output=True, check=True),
            opts.reps,
        )
        job_list = median_seconds(lambda: subprocess.run(openlab, capture_output=True, check=True), opts.reps)
        empty = {**os.environ, "OPENLAB_HOME": str(home / "empty")}  # the command's own start: no job out
        start = median_seconds(lambda: subprocess.run(openlab, capture_output=True, check=True, env=empty), opts.reps)
        batched = median_seconds(lambda: launcher.statuses(handles), opts.reps)
        one_by_one = median_seconds(lambda: Launcher.statuses(launcher, handles), opts.reps)
    finally:
        if job_ids:
            subprocess.run(["scancel", *job_ids], check=False)
        shutil.rmtree(home, ignore_errors=True)

    print(f"\n{opts.jobs} held Slurm jobs, median of {opts.reps}\n")
    print("| what | seconds | against squeue |\n|---|---|---|")
    for name, seconds in (
        ("`squeue -h -j IDS`", squeue),
        ("`openlab job list --json`", job_list),
        ("the same with no job out (Python start, imports, lineage opened)", start),
        ("statuses, one squeue", batched),
        ("one `scontrol show job` per job (before)", one_by_one),
    ):
        print(f"| {name} | {seconds:.3f} | {seconds / squeue:.1f}× |")
    print(f"\none squeue for all against one status per job: {one_by_one / batched:.0f}× faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
