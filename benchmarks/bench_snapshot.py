"""Benchmark: ``openlab snapshot`` against ``b3sum`` and ``dvc add`` on the same data.

Not a test. Builds two data sets under a temp folder -- SIZE bytes in FILES files and
one SIZE-byte file -- then, in one run, times for each:

* openlab cold (empty stat cache) and warm (unchanged data, stat cache hit);
* ``b3sum`` (Debian package; ``find | xargs -0 b3sum`` for the many-files set,
  ``b3sum FILE`` for the big file, which b3sum hashes with all cores);
* ``dvc add`` cold and warm (PyPI ``dvc``, installed into its own virtualenv so its
  dependencies never touch the project's; install time is not measured).

Before each cold run the page cache is dropped when the kernel lets us
(``/proc/sys/vm/drop_caches``); when it does not, every tool runs with a warm page
cache and the report says so. openlab and b3sum report the best of ``--repeat`` runs
(the machine may be shared); dvc runs once. openlab is timed in-process (the library
call, without interpreter start-up); b3sum and dvc as processes.

    .venv/bin/python benchmarks/bench_snapshot.py                # 1 GiB, 10,000 files
    .venv/bin/python benchmarks/bench_snapshot.py --size 64M     # quick check
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.settings import Settings  # noqa: E402
from orchestrator.snapshots import snapshot  # noqa: E402

DEFAULT_DVC_VENV = Path("/tmp/openlab-bench-dvc-venv")


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().rstrip("ib").rstrip("i")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def drop_caches() -> bool:
    """Drop the page cache; False when the sandbox does not allow it."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def make_data(root: Path, size: int, files: int) -> tuple[Path, Path]:
    many = root / "many"
    per_file = max(1, size // files)
    for i in range(files):
        folder = many / f"d{i // 100:03d}"
        if i % 100 == 0:
            folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i:05d}.bin").write_bytes(os.urandom(per_file))
    big = root / "big.bin"
    with big.open("wb") as fh:
        left = size
        while left > 0:
            block = os.urandom(min(left, 16 << 20))
            fh.write(block)
            left -= len(block)
    # age the files past the stat cache's racy window
    time.sleep(0.1)
    return many, big


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(cmd: str, cwd: Path) -> None:
    subprocess.run(cmd, shell=True, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def ensure_b3sum() -> None:
    """Install Debian's ``b3sum`` (not timed) the way the infra scripts install packages,
    so ``make bench`` needs nothing installed by hand; one clear line when it cannot."""
    if shutil.which("b3sum"):
        return
    print("installing b3sum with apt (not timed) ...", flush=True)
    lib = Path(__file__).resolve().parents[1] / "infra" / "lib.sh"
    done = subprocess.run(["bash", "-c", f'source "{lib}" && apt_install b3sum'], check=False)
    if done.returncode != 0 or not shutil.which("b3sum"):
        sys.exit("bench_snapshot: b3sum is missing and apt could not install it; install Debian's b3sum and rerun")


def ensure_dvc(venv: Path) -> Path:
    dvc = venv / "bin" / "dvc"
    if not dvc.exists():
        print(f"installing dvc into {venv} (not timed) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "dvc"], check=True)
    return dvc


@dataclass
class Row:
    data: str
    tool: str
    seconds: float
    nbytes: int

    @property
    def mbps(self) -> float:
        return self.nbytes / self.seconds / 1e6 if self.seconds > 0 else float("inf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1G", help="bytes per data set (default 1G)")
    ap.add_argument("--files", type=int, default=10_000, help="files in the many-files set")
    ap.add_argument("--repeat", type=int, default=3, help="runs of openlab/b3sum, best taken")
    ap.add_argument("--workdir", type=Path, default=None, help="where to build data (default: a temp dir)")
    ap.add_argument("--dvc-venv", type=Path, default=DEFAULT_DVC_VENV)
    ap.add_argument("--no-dvc", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the data afterwards")
    args = ap.parse_args()
    size = parse_size(args.size)

    ensure_b3sum()
    dvc = None if args.no_dvc else ensure_dvc(args.dvc_venv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="openlab-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    data_root = work / "ws"
    data_root.mkdir(exist_ok=True)
    print(f"building data under {data_root} ...", flush=True)
    many, big = make_data(data_root, size, args.files)
    can_drop = drop_caches()
    rows: list[Row] = []

    try:
        for label, target, b3 in (
            (f"{args.files:,} files", many, "find many -type f -print0 | xargs -0 b3sum"),
            ("1 file", big, "b3sum big.bin"),
        ):
            nbytes = (
                sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
                if target.is_dir()
                else target.stat().st_size
            )
            label = f"{label}, {nbytes / (1 << 20):,.0f} MiB"
            colds, warms, b3s = [], [], []
            for rep in range(args.repeat):
                home = work / f"home{rep}"
                settings = Settings(home=home, db_url="sqlite://")
                drop_caches()
                colds.append(timed(lambda s=settings, t=target: snapshot(t, settings=s)))
                start = time.perf_counter()
                warm_snap = snapshot(target, settings=settings)
                warms.append(time.perf_counter() - start)
                assert warm_snap.hashed_files == 0, "warm run re-hashed"
                shutil.rmtree(home)
                drop_caches()
                b3s.append(timed(lambda cmd=b3: run(cmd, data_root)))
            rows += [
                Row(label, "openlab snapshot (cold)", min(colds), nbytes),
                Row(label, "openlab snapshot (warm)", min(warms), nbytes),
                Row(label, "b3sum", min(b3s), nbytes),
            ]
            if dvc is not None:
                name = target.name
                dvc_dir = data_root
                if not (dvc_dir / ".dvc").exists():
                    run(f"{shlex.quote(str(dvc))} init --no-scm -q", dvc_dir)
                drop_caches()
                add = f"{shlex.quote(str(dvc))} add -q {name}"
                for kind in ("cold", "warm"):
                    seconds = timed(lambda cmd=add, d=dvc_dir: run(cmd, d))
                    rows.append(Row(label, f"dvc add ({kind})", seconds, nbytes))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(report(rows, can_drop, " ".join(shlex.quote(a) for a in sys.argv)))
    return 0


def report(rows: list[Row], can_drop: bool, command: str) -> str:
    lines = [
        f"Command: `{command}`  ",
        f"Date: {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}; "
        f"{os.cpu_count()} CPUs; page cache: "
        + (
            "dropped before every cold run"
            if can_drop
            else "**warm page cache for all tools** (drop_caches not permitted)"
        ),
        "",
        "| data | tool | seconds | MB/s |",
        "|---|---|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.data} | {r.tool} | {r.seconds:.3f} | {r.mbps:,.0f} |")
    lines += [
        "",
        "| data | cold vs b3sum (≥ 0.8×) | warm / cold (≤ 2%) | speed-up vs dvc add cold (≥ 5×) |",
        "|---|---:|---:|---:|",
    ]
    for data in dict.fromkeys(r.data for r in rows):
        by = {r.tool: r for r in rows if r.data == data}
        cold, warm, b3 = by["openlab snapshot (cold)"], by["openlab snapshot (warm)"], by["b3sum"]
        dvc = by.get("dvc add (cold)")
        speedup = f"{dvc.seconds / cold.seconds:.1f}×" if dvc else "n/a"
        lines.append(f"| {data} | {cold.mbps / b3.mbps:.2f}× | {100 * warm.seconds / cold.seconds:.1f}% | {speedup} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
