"""Run one command as N tasks on this machine, as ``srun`` does on a Slurm node:
``python -m orchestrator.launchers._tasks N [--nodes M] -- CMD...``.

The local backend's multi-task jobs run under this (one process per task), so a data-parallel
stage can be tried on a workstation with the same contract as on the cluster: each task gets
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT; every line
it prints is prefixed with its rank (``1: ...``, like ``srun --label``); when a task fails the
others are stopped (SIGTERM, SIGKILL after a grace period) and this exits with the code of the task
that failed first, saying which; SIGTERM and SIGUSR1 sent to this process are passed to every task
(a container's stop reaches only its first process, and so does a local cancel or time limit:
the local supervisor signals this process, not its group, so each task is told once). It sits
between the supervisor and the job, so it imports nothing but the standard library: the Docker
launcher mounts its own copy of this file into the container and runs it as a script, so a
multi-task job runs in any image with a Python 3.8 or later, openlab installed or not, and never
under a stale copy baked into an old image.

On one machine (``--nodes`` 1) the tasks meet on 127.0.0.1 at a free port. With ``--nodes M`` this
runs one node's share (a pod of a Kubernetes indexed Job): its node rank is ``$NODE_RANK``, else the
indexed Job's ``$JOB_COMPLETION_INDEX``; the rendezvous (``$MASTER_ADDR``, ``$MASTER_PORT``: node 0)
comes from the launcher; ranks are global (node rank × N + local rank), and so are the line labels
and the task-end records, so the nodes' logs and records read as one job's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_S = 10.0


USAGE = "usage: python -m orchestrator.launchers._tasks N [--nodes M] -- CMD...\n"


def command(python: str, tasks: int, job: list[str], nodes: int = 1, *, script: str | None = None) -> list[str]:
    """The command that runs ``job`` as ``tasks`` tasks (of each of ``nodes`` nodes) under this
    module, with interpreter ``python`` (the host's for local jobs, the image's in a container or pod);
    with ``script``, a copy of this file at that path, run in isolated mode (it needs only the stdlib)."""
    across = ["--nodes", str(nodes)] if nodes > 1 else []
    runner = ["-I", "-S", script] if script else ["-m", "orchestrator.launchers._tasks"]
    return [python, *runner, str(tasks), *across, "--", *job]


def _free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now. (``orchestrator.prefect_server`` has
    the same for the server; this file imports nothing of openlab, see the module docstring.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _placement(nodes: int) -> tuple[int, str, str] | str:
    """(node rank, master address, master port) of this node, or what is missing."""
    if nodes == 1:
        return 0, "127.0.0.1", str(_free_port())
    raw = os.environ.get("NODE_RANK") or os.environ.get("JOB_COMPLETION_INDEX")
    if raw is None or not raw.isdigit() or int(raw) >= nodes:
        return f"{nodes} nodes need this node's rank below {nodes} in $NODE_RANK or $JOB_COMPLETION_INDEX"
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return f"{nodes} nodes need the rendezvous of node 0 in $MASTER_ADDR and $MASTER_PORT"
    return int(raw), addr, port


def _pump(rank: int, stream: object, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
        with lock:
            sys.stdout.buffer.write(f"{rank}: ".encode() + raw)
            sys.stdout.buffer.flush()


def main(argv: list[str]) -> int:
    nodes = 1
    if len(argv) >= 3 and argv[1] == "--nodes" and argv[2].isdigit():
        nodes, argv = int(argv[2]), [argv[0], *argv[3:]]
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit() or int(argv[0]) < 1 or nodes < 1:
        sys.stderr.write(USAGE)
        return 2
    n, command = int(argv[0]), argv[2:]
    placement = _placement(nodes)
    if isinstance(placement, str):
        sys.stderr.write(f"openlab: {placement}\n")
        return 2
    node, addr, port = placement
    world, first_rank = n * nodes, node * n
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    pumps = []
    for local in range(n):
        rank = first_rank + local
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(n),
            "NODE_RANK": str(node),
            "MASTER_ADDR": addr,
            "MASTER_PORT": port,
        }
        if nodes == 1 and os.path.exists("/sys/class/net/lo"):  # every task is here: gloo binds the
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback (a container may have no resolvable hostname)
        try:
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except OSError as exc:  # every task runs the same command: none of them can start
            sys.stderr.write(f"openlab: cannot run {command[0]!r}: {exc.strerror}\n")
            for started in procs:
                started.kill()
            return 127
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(rank, proc.stdout, lock), daemon=True)
        pump.start()
        pumps.append(pump)

    told: list[int] = []  # signals this runner was sent (and passed on)

    def forward(signum: int, _frame: object) -> None:
        told.append(signum)
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
                # Told to stop already (a cancel, a preemption)? Then every task has its SIGTERM, and
                # one ending first is that stop, not a failure: a second one could cut the others'
                # checkpoint saves short. Otherwise a task failed, and the rest are stopped.
                if not any(sig in (signal.SIGTERM, signal.SIGINT) for sig in told):
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
            for local, p in enumerate(procs):
                code = p.returncode if p.returncode >= 0 else 128 - p.returncode
                with open(f"{ends}.{first_rank + local}", "w") as fh:
                    fh.write(f"{first_rank + local} {code} {host} {ended.get(local, time.time())}\n")
        except OSError as exc:  # the record is a courtesy; the exit code below is the outcome
            sys.stderr.write(f"openlab: could not record how the tasks ended in {ends}: {exc}\n")
    if first is None:
        for rank, p in enumerate(procs):  # a last look: a task may have failed in the final poll
            if p.returncode:
                first = (rank, p.returncode if p.returncode >= 0 else 128 - p.returncode)
                break
    if first is None:
        return 0
    local, code = first
    where = f" on node {node}" if nodes > 1 else ""
    if told:  # stopped from outside (a cancel, an eviction, a failed peer node): not a task's failure
        sys.stderr.write(f"openlab: the tasks{where} were stopped by {signal.Signals(told[0]).name} (exit {code})\n")
        return code
    sys.stderr.write(
        f"openlab: task {first_rank + local} of {world}{where} failed first (exit {code}); "
        "the other tasks were stopped\n"
    )
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
