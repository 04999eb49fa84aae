"""Measure what a command used (a container, a Slurm job): ``python -I -S _usage.py [FORWARDING] OUT -- CMD``.

Why inside: a container's cgroup, where the engine keeps its CPU and memory counters, is
deleted the moment the container exits, so nothing outside can read the totals of a job
that has ended, and sampling ``docker stats`` while it runs misses its last second and
sees page cache as memory. The parent of a process can read exactly what it used
(``wait4``), as the local supervisor does (``_supervise.py``), so the Docker launcher
runs the job's command under this, and the numbers mean the same on both backends:
CPU seconds (user + system) of the command and every process it waited for, and the
largest resident set among them.

It runs the command as its child, passes on every signal a job may be sent (a stop, an
interrupt, a preemption warning), writes ``{"cpu_seconds": ..., "max_rss_bytes": ...}``
to ``OUT`` once the command ended, and exits as the command did: its exit
code, or 128 + the signal that killed it, which is what a shell, ``timeout`` and
docker-init report for a killed child. If the command cannot start it exits 127, like
a shell. Where it is the container's first process (a Kubernetes pod, which has no
docker-init) it reaps orphans as an init does, and counts what they used. When ``OUT``
cannot be written the job's outcome is unchanged; only the record of what it used is
missing.

``--warn-after=SECONDS`` sends the command SIGUSR1 that long after it started: the warning ahead
of a time limit that Slurm gives with ``--signal=USR1@N``, for a Kubernetes pod, whose
``activeDeadlineSeconds`` ends it with SIGTERM alone (not with ``--slurm-batch``, which has the
alarm, and Slurm warns by itself).

``--forward=SIGUSR1,SIGUSR2`` passes on only those and outlives the others; ``--no-forward``
passes on nothing. Under Slurm, which signals every process of a job step (a cancel, a
preemption, ``--signal`` without ``B:``), the command has been sent those signals already, and
passing them on would deliver them twice: a task under ``srun`` takes ``--no-forward``. The
batch script of a one-task job execs the wrapper, so the wrapper is what a signal for the batch
shell alone reaches (``--signal=B:USR1@300``, ``--signal=B:TERM@120``, ``scancel --batch``),
and that one the command has not had. ``--slurm-batch`` tells the two apart: Slurm ends a job
(a cancel, its time limit, a preemption) by sending every process of it SIGCONT and then SIGTERM,
while ``scancel --batch`` sends the batch shell its signal alone. So a stop signal within a second
of a SIGCONT is not passed on, and any other is, a moment later (by then the SIGCONT sent just
before it has been seen: Python runs the handlers of signals that arrived together lowest number
first, TERM before CONT). SIGUSR1 and SIGUSR2 are always passed on, at once: Slurm never ends a job
with them, and its time-limit warning (``--signal=B:USR1@N``) comes with a SIGCONT of its own a few
milliseconds after it (Slurm 22.05), so held against the SIGCONT the warning was lost and training
never saved before its limit. The command's own handlers decide what a signal does; the wrapper
stays to record what it used.

The Docker launcher copies this file into a folder it mounts into the container, and the
Kubernetes launcher sends it in a ConfigMap mounted into the pod, so the copy that runs is
their own, whatever the image holds; a pod writes to its termination message file, which the
kubelet hands back in the pod's status. The Slurm launcher copies it next to the job logs
(a folder the nodes share). Stdlib only, no imports that need ``site``, nothing newer than
Python 3.8: it runs on the image's (or node's) interpreter.
"""

import os
import sys
import time

try:  # the C module: ``signal`` wraps it in enums, which costs an import of ``enum``
    import _signal as signal
except ImportError:  # pragma: no cover - not CPython
    import signal

#: Signals passed on to the command: a stop (docker stop, timeout), an interrupt, a hang-up,
#: and the warnings a scheduler or a user may send before a stop.
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def _write(path, cpu_seconds, max_rss_bytes):
    # In place, not through a renamed temp file: OUT may be a file mounted into the container
    # (Kubernetes' /dev/termination-log), which cannot be replaced; and it is read only once the
    # container has ended, so nobody sees it half-written.
    with open(path, "w") as fh:
        fh.write(f'{{"cpu_seconds": {cpu_seconds!r}, "max_rss_bytes": {max_rss_bytes:d}}}')


#: Signals Slurm never ends a job with: at the batch shell, always for it (``--slurm-batch``).
WARNINGS = ("SIGUSR1", "SIGUSR2")
#: How close to a SIGCONT (seconds) a signal is Slurm ending the job (``--slurm-batch``).
SLURM_END_WINDOW = 1.0
#: How long ``--slurm-batch`` holds a signal before deciding (seconds): ample for the SIGCONT sent
#: just before it to have been handled.
HOLD = 0.1


def main(argv):
    relay, slurm_batch, warn_after = set(FORWARDED), False, 0.0
    flags = ("--forward=", "--warn-after=")
    while argv and (argv[0] in ("--no-forward", "--slurm-batch") or argv[0].startswith(flags)):
        flag, argv = argv[0], argv[1:]
        if flag == "--no-forward":
            relay = set()
        elif flag == "--slurm-batch":
            slurm_batch = True
        elif flag.startswith("--warn-after="):
            warn_after = float(flag.split("=", 1)[1])
        else:
            relay = {n for n in flag.split("=", 1)[1].split(",") if n}
    if len(argv) < 3 or argv[1] != "--" or (warn_after and slurm_batch):
        sys.stderr.write(
            "usage: python -I -S _usage.py [--forward=SIG,... | --no-forward | --slurm-batch | --warn-after=SECONDS]"
            " OUT -- CMD...\n"
        )
        return 2
    out, cmd = argv[0], argv[2:]
    child = {"pid": None}
    pending = []  # signals that came before the command existed
    relayed = {getattr(signal, name) for name in relay if hasattr(signal, name)}
    warnings = {getattr(signal, name) for name in WARNINGS if hasattr(signal, name)}
    held = []  # --slurm-batch: (signal, when) not yet passed on
    cont = {"at": None}  # --slurm-batch: when the last SIGCONT came

    def send(signum):
        if child["pid"] is None:
            pending.append(signum)
            return
        try:
            os.kill(child["pid"], signum)
        except OSError:
            pass

    def forward(signum, _frame):
        if signum not in relayed:  # the command got it too (see the module docstring); outlive it, nothing more
            return
        if slurm_batch and signum not in warnings:  # decide once a SIGCONT that came with it has been seen
            held.append((signum, time.monotonic()))
            signal.setitimer(signal.ITIMER_REAL, HOLD)
            return
        send(signum)

    def on_cont(_signum, _frame):
        cont["at"] = time.monotonic()

    def decide(_signum, _frame):
        while held:
            signum, at = held.pop(0)
            if cont["at"] is None or abs(at - cont["at"]) > SLURM_END_WINDOW:  # for the batch shell alone
                send(signum)

    def warn(_signum, _frame):
        send(signal.SIGUSR1)

    if slurm_batch:
        signal.signal(signal.SIGCONT, on_cont)
        signal.signal(signal.SIGALRM, decide)
    elif warn_after > 0:
        signal.signal(signal.SIGALRM, warn)

    sigs = [getattr(signal, name) for name in FORWARDED if hasattr(signal, name)]
    for sig in sigs:
        signal.signal(sig, forward)

    pid = os.fork()
    if pid == 0:
        # ...and those Python ignores, which stay ignored across exec: a job starts as a shell starts it
        restored = [getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, name)]
        for sig in [*sigs, signal.SIGCONT, signal.SIGALRM, *restored]:
            signal.signal(sig, signal.SIG_DFL)
        try:
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            sys.stderr.write(f"openlab: cannot run {cmd[0]!r}: {exc.strerror}\n")
            sys.stderr.flush()
            os._exit(127)
    child["pid"] = pid
    for sig in pending:
        send(sig)
    if warn_after > 0:
        signal.setitimer(signal.ITIMER_REAL, warn_after)

    # Any child, not just the command: as a pod's first process (PID 1) the wrapper is also the
    # parent of every orphan in the container, and an init that does not reap them leaves them as
    # zombies until the pod ends. What a reaped orphan used counts with the job's.
    cpu_seconds, max_rss = 0.0, 0
    while True:
        ended, status, usage = os.wait4(-1, 0)  # a signal handled meanwhile does not end the wait (PEP 475)
        cpu_seconds += usage.ru_utime + usage.ru_stime
        max_rss = max(max_rss, usage.ru_maxrss)
        if ended == pid:
            break
    try:  # ru_maxrss is in KiB on Linux
        _write(out, round(cpu_seconds, 3), max_rss * 1024)
    except OSError as exc:
        sys.stderr.write(f"openlab: could not record what the job used in {out}: {exc.strerror}\n")
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
