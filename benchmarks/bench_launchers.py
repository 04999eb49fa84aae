"""Launcher overhead against the raw tool doing the same work (a benchmark, not a test).

For each reachable backend, in one run, side by side, median of ``--reps`` runs:

- **total**: the whole life of a trivial job (``true``): submit, wait, collect the log,
  clean up. Raw: ``subprocess.run(["true"])``; ``docker run --rm --network none IMAGE true``;
  ``sbatch --parsable --wrap true`` + polling ``scontrol show job`` until it ends.
  Launcher: :func:`orchestrator.launchers.attempts.run_job` with log streaming, into a
  throw-away SQLite lineage store — the path every stage takes, lineage writes included.
- **submit→running**: until the job is seen running (``sleep 2``). Raw: ``Popen`` returning;
  ``docker run -d`` returning (it returns once the container started); ``sbatch --wrap`` +
  polling ``squeue`` until RUNNING. Launcher: ``submit()`` + polling ``status()``.

Both sides poll the same way: after 10, 20, 40 ... ms, then every ``--poll`` seconds.

- **watching a job** (``--watch`` s, default 10, a ``sleep`` job): what waiting out a running
  job costs and how late its end is seen, the launcher at its own cadence (``poll=None``,
  what pipelines use) against the tool's own blocking wait: ``subprocess.run``;
  ``docker run -d`` + ``docker wait``; ``sbatch --wait``. Reported: wall time past the
  job's length, status looks, and CPU seconds of this process and its children (scontrol,
  the docker CLI). Engine and controller CPU is not in it; the looks are its proxy.
Kubernetes is left out: no real API server runs on these machines, and against the test
emulator there is no raw tool to compare.

    python benchmarks/bench_launchers.py [--reps 5] [--backends local,docker,slurm] [--image IMG]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.launchers import Backoff, JobSpec, JobState, get_launcher  # noqa: E402
from orchestrator.launchers.attempts import run_job  # noqa: E402
from orchestrator.lineage.store import LineageStore  # noqa: E402


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(fn: Callable[[], float | None], reps: int) -> float:
    values = [v for v in (fn() for _ in range(reps)) if v is not None]
    return statistics.median(values)


# -- raw tools ----------------------------------------------------------------------------------------


def raw_local_total() -> float:
    return timed(lambda: subprocess.run(["true"], check=True))


def raw_local_s2r() -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(["sleep", "2"])
    elapsed = time.perf_counter() - start
    proc.kill()
    proc.wait()
    return elapsed


def raw_docker_total(image: str) -> float:
    return timed(
        lambda: subprocess.run(
            ["docker", "run", "--rm", "--network", "none", image, "true"], check=True, capture_output=True
        )
    )


def raw_docker_s2r(image: str) -> float:
    start = time.perf_counter()
    cid = subprocess.run(
        ["docker", "run", "-d", "--network", "none", image, "sleep", "2"], check=True, capture_output=True, text=True
    ).stdout.strip()
    elapsed = time.perf_counter() - start
    subprocess.run(["docker", "rm", "-f", cid], check=True, capture_output=True)
    return elapsed


def slurm_settle() -> None:
    """Wait until the node is idle again: a job submitted while the last one is still completing waits
    for the next scheduling pass (seconds), which would measure the cluster, not the launcher."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True).stdout.split()
        queue = subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip()
        if states and all(s == "idle" for s in states) and not queue:
            return
        time.sleep(0.1)


def raw_slurm_total(poll: float) -> float:
    slurm_settle()
    start = time.perf_counter()
    job = (
        subprocess.run(
            ["sbatch", "--parsable", "--output=/dev/null", "--wrap", "true"], check=True, capture_output=True, text=True
        )
        .stdout.strip()
        .split(";")[0]
    )
    backoff = Backoff(poll)
    while True:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
        if "JobState=COMPLETED" in out or "JobState=FAILED" in out:
            return time.perf_counter() - start
        backoff.sleep()


def raw_slurm_s2r(poll: float) -> float:
    slurm_settle()
    start = time.perf_counter()
    job = (
        subprocess.run(
            ["sbatch", "--parsable", "--output=/dev/null", "--wrap", "sleep 2"],
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .split(";")[0]
    )
    backoff = Backoff(poll)
    while True:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout
        if "RUNNING" in state or not state.strip():
            elapsed = time.perf_counter() - start
            subprocess.run(["scancel", job], capture_output=True)
            return elapsed
        backoff.sleep()


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children so far."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def watched(fn: Callable[[], int]) -> tuple[float, int, float]:
    """(wall s, status looks, CPU s) of ``fn``, which waits out one job and returns its looks."""
    cpu, start = cpu_seconds(), time.perf_counter()
    looks = fn()
    return time.perf_counter() - start, looks, cpu_seconds() - cpu


def raw_watch(name: str, image: str | None, seconds: float) -> int:
    job = f"sleep {seconds:g}"
    if name == "local":
        subprocess.run(job.split(), check=True)
    elif name == "docker":
        cid = subprocess.run(
            ["docker", "run", "-d", "--network", "none", str(image), *job.split()],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        subprocess.run(["docker", "wait", cid], check=True, capture_output=True)
        subprocess.run(["docker", "rm", cid], check=True, capture_output=True)
    else:
        slurm_settle()
        subprocess.run(["sbatch", "--wait", "--output=/dev/null", "--wrap", job], check=True, capture_output=True)
    return 1


def launcher_watch(store: LineageStore, name: str, image: str | None, seconds: float) -> int:
    launcher = get_launcher(name, image=image) if image else get_launcher(name)
    if name == "slurm":
        slurm_settle()
    looks = 0
    status = launcher.status

    def counted(handle: object) -> object:
        nonlocal looks
        looks += 1
        return status(handle)  # type: ignore[arg-type]

    launcher.status = counted  # type: ignore[method-assign]
    _, final = run_job(store, launcher, JobSpec(name="bench", command=["sleep", f"{seconds:g}"], image=image))
    assert final.state is JobState.SUCCEEDED, final
    return looks


# -- launchers -------------------------------------------------------------------------------------------


def launcher_total(store: LineageStore, name: str, image: str | None, poll: float) -> float:
    launcher = get_launcher(name, image=image) if image else get_launcher(name)
    lines: list[str] = []
    if name == "slurm":
        slurm_settle()
    start = time.perf_counter()
    _, status = run_job(
        store, launcher, JobSpec(name="bench", command=["true"], image=image), on_log=lines.append, poll=poll
    )
    elapsed = time.perf_counter() - start
    assert status.state is JobState.SUCCEEDED, status
    return elapsed


def launcher_s2r(name: str, image: str | None, poll: float) -> float:
    launcher = get_launcher(name, image=image) if image else get_launcher(name)
    if name == "slurm":
        slurm_settle()
    start = time.perf_counter()
    handle = launcher.submit(JobSpec(name="bench", command=["sleep", "2"], image=image))
    backoff = Backoff(poll)
    while launcher.status(handle).state is JobState.PENDING:
        backoff.sleep()
    elapsed = time.perf_counter() - start
    launcher.cancel(handle)
    launcher.cleanup(handle)
    return elapsed


def available(name: str, image: str | None) -> str | None:
    """None when the backend can run the benchmark, else why not."""
    launcher = get_launcher(name, image=image) if image else get_launcher(name)
    ok, detail = launcher.check()
    if not ok:
        return detail
    if name == "docker" and "missing" in detail:
        return detail
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backends", default="local,docker,slurm")
    parser.add_argument("--image", default=os.environ.get("OPENLAB_TEST_IMAGE", "openlab/python-base:bookworm"))
    parser.add_argument("--poll", type=float, default=0.1, help="status poll interval, both sides")
    parser.add_argument("--watch", type=float, default=10.0, help="length of the watched job, s (0: skip)")
    parser.add_argument("--watch-reps", type=int, default=3)
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="openlab-bench-"))
    os.environ["OPENLAB_HOME"] = str(home)
    os.environ.pop("OPENLAB_DB_URL", None)
    rows, watch_rows = [], []
    with LineageStore(f"sqlite:///{home / 'lineage.db'}") as store:
        for name in args.backends.split(","):
            image = args.image if name == "docker" else None
            why = available(name, image)
            if why:
                rows.append(f"| {name} | not run: {why} | | | | | | |")
                continue
            # warm up (imports, image cache, first sbatch) before measuring
            launcher_total(store, name, image, args.poll)
            raw_total: Callable[[], float]
            raw_s2r: Callable[[], float]
            if name == "local":
                raw_total, raw_s2r, tool = raw_local_total, raw_local_s2r, "subprocess"
            elif name == "docker":
                img = str(image)
                raw_total, raw_s2r = (lambda: raw_docker_total(img)), (lambda: raw_docker_s2r(img))  # noqa: B023
                tool = "docker run"
            else:
                raw_total, raw_s2r = (lambda: raw_slurm_total(args.poll)), (lambda: raw_slurm_s2r(args.poll))
                tool = "sbatch + poll"
            rt = median(raw_total, args.reps)
            lt = median(lambda: launcher_total(store, name, image, args.poll), args.reps)  # noqa: B023
            rs = median(raw_s2r, args.reps)
            ls = median(lambda: launcher_s2r(name, image, args.poll), args.reps)  # noqa: B023
            rows.append(
                f"| {name} | {tool} | {rt:.3f} | {lt:.3f} | {lt / rt:.2f}x (+{(lt - rt) * 1000:.0f} ms) "
                f"| {rs:.3f} | {ls:.3f} | {ls / rs:.2f}x (+{(ls - rs) * 1000:.0f} ms) |"
            )
            if args.watch > 0:
                raw = [watched(lambda: raw_watch(name, image, args.watch)) for _ in range(args.watch_reps)]  # noqa: B023
                ours = [
                    watched(lambda: launcher_watch(store, name, image, args.watch))  # noqa: B023
                    for _ in range(args.watch_reps)
                ]
                wait_tool = {"local": "subprocess.run", "docker": "docker wait", "slurm": "sbatch --wait"}[name]
                (rw, _, rc), (lw, looks, lc) = (
                    [statistics.median(x[i] for x in sample) for i in range(3)] for sample in (raw, ours)
                )
                watch_rows.append(
                    f"| {name} | {wait_tool} | +{rw - args.watch:.2f} | +{lw - args.watch:.2f} | {looks:.0f} "
                    f"| {rc:.2f} | {lc:.2f} | {lc / rc:.2f}x |"
                )
    print(f"median of {args.reps} runs, poll {args.poll}s, times in seconds\n")
    print(
        "| backend | raw tool | raw total | launcher total | ratio "
        "| raw submit→running | launcher submit→running | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if watch_rows:
        print(f"\nwatching a {args.watch:g} s job, median of {args.watch_reps}; launcher at its own cadence\n")
        print(
            "| backend | raw wait | raw late (s) | launcher late (s) | launcher looks "
            "| raw CPU (s) | launcher CPU (s) | CPU ratio |"
        )
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(watch_rows))


if __name__ == "__main__":
    main()
