"""Run every benchmark in this folder, one after another, in one session (``make bench``).

Each ``bench_*.py`` script compares openlab with the tool a user would otherwise use and
prints its own markdown table; this runner only sequences them, so the numbers in the
README table all come from one run on one machine state. Scripts run as subprocesses of
the same interpreter (the project's venv) so one benchmark's imports and caches cannot
flatter the next.

    python benchmarks/run_all.py                 # full sizes, as the README table was made
    python benchmarks/run_all.py --quick         # smaller inputs, for checking the scripts work
    python benchmarks/run_all.py --only launchers,stage_overhead
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: Arguments per benchmark: (full run, quick run). Full runs are what the README quotes.
ARGS: dict[str, tuple[list[str], list[str]]] = {
    "snapshot": ([], ["--size", "64M", "--files", "1000", "--repeat", "1", "--no-dvc"]),
    "launchers": ([], ["--reps", "2"]),
    "stage_overhead": ([], ["--stages", "3", "--rounds", "1"]),
    "moe_step": (["--steps", "12"], ["--steps", "3"]),
    "trace": (["--runs", "1000"], ["--runs", "30", "--repeat", "2"]),
    "data_parallel": (["--steps", "12"], ["--steps", "2", "--batch", "4"]),
    "job_list": ([], ["--jobs", "20", "--reps", "2"]),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small inputs: checks the scripts, not the numbers")
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(ARGS)}")
    opts = ap.parse_args()

    wanted = [name.strip() for name in opts.only.split(",") if name.strip()] or list(ARGS)
    unknown = [name for name in wanted if name not in ARGS]
    if unknown:
        print(f"error: unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(ARGS)}", file=sys.stderr)
        return 2

    results: list[tuple[str, int, float]] = []
    for index, name in enumerate(wanted, 1):
        script = HERE / f"bench_{name}.py"
        argv = [sys.executable, str(script), *ARGS[name][1 if opts.quick else 0]]
        print(f"\n=== [{index}/{len(wanted)}] {name}: {' '.join(argv[1:])}", flush=True)
        started = time.perf_counter()
        rc = subprocess.call(argv, cwd=HERE.parent)
        results.append((name, rc, time.perf_counter() - started))

    print("\n| benchmark | exit | wall (s) |\n|---|---|---|")
    for name, rc, wall in results:
        print(f"| {name} | {rc} | {wall:.1f} |")
    failed = [name for name, rc, _ in results if rc != 0]
    if failed:
        print(f"error: benchmark(s) failed: {', '.join(failed)}; their output above says why", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
