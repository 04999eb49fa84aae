"""Small helpers shared by the stages: atomic writes, fingerprints, device and thread choice."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temp file in the same directory + os.replace, so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # through the open file, not its name: torch names the archive inside after the file it is given,
        # and the temp file's random name made two saves of the same state differ in those bytes
        with os.fdopen(fd, "wb") as out:
            torch.save(obj, out)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def config_fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def pick_device(name: str) -> torch.device:
    """The device a stage runs on; ``cuda`` where this machine has none is one line (a WorkloadError),
    where torch's AssertionError came after the model was built. Asked where the job runs, not where
    the recipe was checked: an orchestrator without a GPU sends jobs to nodes that have one."""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        from .config import WorkloadError

        raise WorkloadError("config: device is cuda, and this machine has no CUDA GPU torch can use; use auto or cpu")
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def setup_torch(n: int) -> int:
    """Use the cores this process may run on (not the host's count, which lies inside containers),
    with deterministic kernels.

    Determinism is what lets a rerun confirm a result: with torch's default kernels the scatter-adds
    of the MoE combine (and their backward) accumulate in thread-scheduling order, so two 2-thread
    runs of one config differed from step 2, and the QB fixed-point iteration carried the difference
    into every drop figure. Deterministic mode makes one config on one thread count repeat to the bit
    (a different thread count still sums in another order). "warn": an op without a deterministic
    kernel (some CUDA ones) warns instead of stopping a run. This is
    ``use_deterministic_algorithms(True, warn_only=True)`` without its import of torch's compiler
    (for its ``deterministic`` flag, which nothing here compiles for): 1.4 s of every stage's start.
    """
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for repeatable GEMMs
    torch.set_deterministic_debug_mode("warn")
    if n <= 0:
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - non-Linux
            n = os.cpu_count() or 1
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


class Preempted(Exception):  # noqa: N818 - it is an event, not an error of the program
    """A stop signal arrived; the step in progress finished and a checkpoint was saved.

    SIGTERM is how every backend stops a job: Slurm at its time limit or on preemption, Docker
    and Kubernetes on stop or eviction, the local launcher on cancel. SIGUSR1 is what Slurm's
    ``--signal=B:USR1@SECONDS`` sends ahead of the time limit. Either way the stage exits
    ``128 + signal`` (not 0: the stage is not done), and a rerun resumes from this step.
    """

    def __init__(self, signum: int, step: int) -> None:
        self.signum, self.step = signum, step
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved, a rerun resumes from it"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Remembers a SIGTERM or SIGUSR1 instead of dying on it, so a loop can stop at a step boundary.

    A context manager for the main thread (where Python delivers signals); the previous handlers
    come back on exit. Elsewhere (a thread, an embedding) it installs nothing and never fires.
    """

    #: The orchestrator reads an exit by one of these as "stopped from outside" (its
    #: ``launchers.base.STOP_SIGNALS``, kept equal by a test; the workload imports nothing of it).
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def _note(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._note) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
