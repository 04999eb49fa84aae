"""Run one command as N tasks on this machine, as ``srun`` does on a Slurm node:
``python -m orchestrator.launchers._tasks N -- CMD...``.

The local backend's multi-task jobs run under this (one process per task), so a data-parallel
stage can be tried on a workstation with the same contract as on the cluster: each task gets
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK (0), MASTER_ADDR (127.0.0.1) and a free
MASTER_PORT; every line it prints is prefixed with its rank (``1: ...``, like ``srun --label``);
when a task fails the others are stopped (SIGTERM, SIGKILL after a grace period) and this exits
with the code of the task that failed first, saying which; SIGTERM and SIGUSR1 sent to this
process are passed to every task (a container's stop reaches only its first process). A local
cancel or time limit signals the whole process group, so there a task gets the signal twice: a
stop handler must not mind (the workload's ``StopSignals`` only notes it). It sits between the
supervisor and the job, so it imports nothing beyond what ``orchestrator.launchers`` already loads.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from orchestrator.prefect_server import free_port

GRACE_S = 10.0


def command(python: str, tasks: int, job: list[str]) -> list[str]:
    """The command that runs ``job`` as ``tasks`` tasks under this module, with interpreter ``python``
    (the host's for local jobs, the image's in a container or pod)."""
    return [python, "-m", "orchestrator.launchers._tasks", str(tasks), "--", *job]


def _pump(rank: int, stream: object, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
        with lock:
            sys.stdout.buffer.write(f"{rank}: ".encode() + raw)
            sys.stdout.buffer.flush()


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit() or int(argv[0]) < 1:
        sys.stderr.write("usage: python -m orchestrator.launchers._tasks N -- CMD...\n")
        return 2
    n, command = int(argv[0]), argv[2:]
    port = str(free_port())
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    pumps = []
    for rank in range(n):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(n),
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        if os.path.exists("/sys/class/net/lo"):  # every task is here: gloo binds the loopback (a container
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # may have no resolvable hostname to bind by)
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(rank, proc.stdout, lock), daemon=True)
        pump.start()
        pumps.append(pump)

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, forward)

    first: tuple[int, int] | None = None  # (rank, code) of the first task to fail
    stop_at: float | None = None
    ended: dict[int, float] = {}
    while any(p.poll() is None for p in procs):
        for rank, p in enumerate(procs):
            code = p.poll()
            if code is not None:
                ended.setdefault(rank, time.time())
            if code is not None and code != 0 and first is None:
                first = (rank, code if code >= 0 else 128 - code)
                stop_at = time.monotonic() + GRACE_S
                for other in procs:
                    if other.poll() is None:
                        other.terminate()
        if stop_at is not None and time.monotonic() > stop_at:
            for other in procs:
                if other.poll() is None:
                    other.kill()
        time.sleep(0.05)
    for pump in pumps:
        pump.join(5)
    ends = os.environ.get("OPENLAB_TASK_ENDS")  # how each task ended, for the launcher's record
    if ends:
        host = socket.gethostname()
        try:
            os.makedirs(os.path.dirname(ends) or ".", exist_ok=True)
            for rank, p in enumerate(procs):
                code = p.returncode if p.returncode >= 0 else 128 - p.returncode
                with open(f"{ends}.{rank}", "w") as fh:
                    fh.write(f"{rank} {code} {host} {ended.get(rank, time.time())}\n")
        except OSError as exc:  # the record is a courtesy; the exit code below is the outcome
            sys.stderr.write(f"openlab: could not record how the tasks ended in {ends}: {exc}\n")
    if first is None:
        for rank, p in enumerate(procs):  # a last look: a task may have failed in the final poll
            if p.returncode:
                first = (rank, p.returncode if p.returncode >= 0 else 128 - p.returncode)
                break
    if first is None:
        return 0
    rank, code = first
    sys.stderr.write(f"openlab: task {rank} of {n} failed first (exit {code}); the other tasks were stopped\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
