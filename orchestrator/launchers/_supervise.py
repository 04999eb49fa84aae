"""Supervisor of one local job; run as ``python -I -S _supervise.py RUN LIMIT WARN GRACE WORKDIR -- CMD...``.

Why a supervisor: a local job must outlive the process that submitted it, keep its time
limit without anyone polling, and leave its exit code where *another* process (``openlab
job status ID``) can read it. Only the parent of a process can read its exit status, so a
tiny supervisor is that parent and writes the outcome into its own JSON file ``RUN``
(``$OPENLAB_HOME/jobs/local/ID.run.json``); the launcher owns ``ID.json`` and reads both, so
the two writers never race on one file.

The supervisor runs in its own session and the job in its own process group, so the supervisor can
end the whole group: on SIGTERM/SIGINT/SIGHUP (cancel) or SIGALRM (time limit) it sends SIGTERM to
the group, then SIGKILL after the grace period; WARN seconds before the time limit (when not 0) it
sends SIGUSR1 first, the warning Slurm's ``--signal=B:USR1@WARN`` gives, for a job to checkpoint. A
job whose first process passes a stop on to the others itself (the multi-task runner,
``launchers/_tasks.py``; the launcher says so with ``$OPENLAB_STOP_FIRST_PROCESS``) gets the SIGTERM
at that process only, so each task is told once, as srun and a container's stop tell it; the SIGKILL
still goes to the whole group. When the job's main process exits, any processes it left behind in
its group are killed too, like Slurm and Docker do. The supervisor exits right after writing the
outcome, so its exit is the moment a waiter (``LocalLauncher.pause``, through a pidfd) can stop
waiting.

Stdlib only, imported by path with ``-S``, and only modules that need no Python-level
imports (``os``, ``sys``, ``time``, ``_signal``): it sits on every local job's critical
path, and ``json`` (``re``, ``enum``), ``socket`` and ``signal`` (``enum``) once cost
~30 ms of a ~45 ms start on a busy machine. Hence the hand-written JSON below, which only
has to encode a flat dict of strings, numbers and None.
"""

import os
import sys
import time

try:  # the C module: ``signal`` itself wraps it in enums, and importing enum costs ~8 ms
    import _signal as signal
except ImportError:  # pragma: no cover - not CPython
    import signal


def _json_str(text):
    out = ['"']
    for ch in text:
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        elif ch < " ":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def dumps(data):
    """JSON for a flat dict of str / int / float / bool / None (all the supervisor writes)."""
    parts = []
    for key, value in data.items():
        if value is None:
            text = "null"
        elif value is True or value is False:
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = _json_str(str(value))
        parts.append(_json_str(key) + ": " + text)
    return "{" + ", ".join(parts) + "}"


def _write(path, data):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(dumps(data))
    os.replace(tmp, path)


def main(argv):
    run_path, limit, warn, grace, workdir = argv[0], float(argv[1]), float(argv[2]), float(argv[3]), argv[4]
    cmd = argv[6:] if argv[5] == "--" else argv[5:]

    why = {"stop": None, "killed": False, "pid": None, "warned": not 0 < warn < limit}
    # the job's own first process passes a graceful stop on (read here, not passed on to the job)
    first_only = os.environ.pop("OPENLAB_STOP_FIRST_PROCESS", "") == "1"

    def kill(sig):
        if why["pid"] is not None:
            try:
                if first_only and sig != signal.SIGKILL:
                    os.kill(why["pid"], sig)
                else:
                    os.killpg(why["pid"], sig)
            except OSError:
                pass

    def stop(reason):
        if why["stop"] is None:
            why["stop"] = reason
            kill(signal.SIGTERM)
            signal.alarm(max(1, int(round(grace))))
        elif not why["killed"]:
            why["killed"] = True
            kill(signal.SIGKILL)

    def on_cancel(_signum, _frame):
        stop("cancelled")

    def on_alarm(_signum, _frame):
        if not why["warned"] and why["stop"] is None:  # WARN before the limit: SIGUSR1, as Slurm's --signal
            why["warned"] = True
            kill(signal.SIGUSR1)
            signal.setitimer(signal.ITIMER_REAL, warn)
            return
        stop("time limit exceeded")  # base.TIME_LIMIT_REASON (this module imports nothing of ours)

    # handlers first, so a cancel that arrives while the job starts is not lost
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_cancel)
    signal.signal(signal.SIGALRM, on_alarm)

    # Why the command could not start, if it could not: the child writes it here; the pipe is
    # close-on-exec, so a command that did start leaves it empty. Exit 127 alone cannot tell a
    # program that is not there from a program that exited 127 (as a shell does for its own).
    not_started, told = os.pipe()
    pid = os.fork()
    if pid == 0:  # the job, in its own process group (the supervisor already has its own session)
        os.close(not_started)
        os.setpgid(0, 0)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM):
            signal.signal(sig, signal.SIG_DFL)
        what = f"cannot run {cmd[0]!r}"
        try:
            if workdir:
                what = f"cannot enter the working directory {workdir!r}"
                os.chdir(workdir)
                what = f"cannot run {cmd[0]!r}"
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            sys.stderr.write(f"openlab: {what}: {exc.strerror}\n")
            sys.stderr.flush()
            os.write(told, f"{what}: {exc.strerror}".encode())
            os._exit(127)
    os.close(told)
    try:  # set it from both sides, so the group exists before anyone signals it
        os.setpgid(pid, pid)
    except OSError:
        pass
    why["pid"] = pid
    if why["stop"] is not None:
        kill(signal.SIGTERM)

    state = {"state": "RUNNING", "pgid": pid, "host": os.uname().nodename, "started_at": time.time()}
    _write(run_path, state)
    if limit > 0:
        signal.setitimer(signal.ITIMER_REAL, limit - warn if 0 < warn < limit else limit)

    usage = None
    while True:
        try:  # wait4: the exit status and what the job used (it and every process it waited for)
            _, status, usage = os.wait4(pid, 0)
            break
        except ChildProcessError:
            status = 255 << 8
            break
    signal.setitimer(signal.ITIMER_REAL, 0)
    try:  # nothing of the job outlives it
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass

    if os.WIFSIGNALED(status):
        code = 128 + os.WTERMSIG(status)
    else:
        code = os.WEXITSTATUS(status)
    with os.fdopen(not_started, "rb") as fh:  # every writer is gone: the job exec'd or exited
        start_error = fh.read(1000).decode("utf-8", "replace")
    if why["stop"] == "cancelled":
        final, reason = "CANCELLED", "cancelled"
    elif why["stop"] == "time limit exceeded":
        final, reason = "FAILED", f"time limit exceeded ({limit:g}s)"
    elif code == 0:
        final, reason = "SUCCEEDED", None
    elif os.WIFSIGNALED(status):
        final, reason = "FAILED", f"killed by signal {os.WTERMSIG(status)}"
    elif start_error:
        final, reason = "FAILED", f"exit code {code}: {start_error}"
    else:
        final, reason = "FAILED", f"exit code {code}"
    state.update(state=final, exit_code=code, reason=reason, ended_at=time.time())
    if usage is not None:  # ru_maxrss is in KiB on Linux
        state.update(max_rss_bytes=usage.ru_maxrss * 1024, cpu_seconds=round(usage.ru_utime + usage.ru_stime, 3))
    _write(run_path, state)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
