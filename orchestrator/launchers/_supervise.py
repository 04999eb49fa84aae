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

Secrets stay out of the log (``orchestrator.secrets``): where the job's environment holds a secret
value (a variable whose name has TOKEN, KEY, SECRET, PASSWORD, PASSWD or CREDENTIAL in it, of
:data:`MIN_SECRET_LENGTH` characters or more: that module's rule, copied here, and
tests/core/test_secrets.py checks that the two agree), the job does not write its log file itself:
its output comes to the supervisor through a pipe and goes on to the log (the supervisor's own
standard output) chunk by chunk, as it comes, with each such value replaced by ``***`` (:func:`pump`).
A value cut in two by a read is still caught: an end of a chunk that a secret value begins with waits
for the next one. Bytes are kept as they are, partial lines and binary output included. When the
job's main process exits, its group is killed (as above) and what is left in the pipe is read, so a
process that left the group and keeps the pipe open does not hold up the end (what such a process
writes after that is lost). If the supervisor itself dies (SIGKILL), the job's writes fail with
EPIPE; the launcher reports such a job LOST and ends it anyway. Without such values the job's output
goes straight to the log file, as it always did, with no copying.

The same file is the filter a Slurm job's output goes through where the job's environment holds
secrets (the Slurm launcher copies it beside the logs and the batch script runs it):
``python -I -S _supervise.py --mask-output (--slurm-batch | --no-forward) -- CMD...`` runs CMD as its
child, its output through :func:`pump` to standard output (the file slurmstepd writes, or the step's
output that srun labels), and exits with CMD's exit code (128 + the signal that killed it, as the
usage wrapper and a shell say it). ``--no-forward`` (a task of an srun step: Slurm
signals every process of the step itself) outlives the stop signals without passing them on;
``--slurm-batch`` (the batch shell's own process) passes on a signal for the batch shell alone
(``--signal=B:USR1@300``, ``scancel --batch``) and not the SIGTERM with which Slurm ends a job, which
CMD gets itself, told apart by the SIGCONT Slurm sends every process just before it, as the usage
wrapper (``launchers/_usage.py``) does; SIGUSR1 and SIGUSR2, which Slurm never ends a job with and
whose ``B:`` warning comes with a SIGCONT of its own, always. Without secrets in its environment it
execs CMD, so it is not there at all. That mode runs on the node's Python: nothing newer than Python 3.8 in this file.

A job that asks for GPUs on a machine whose GPUs the launcher knows (``$OPENLAB_GPUS``:
``COUNT:ID,ID,...``) is given GPUs no other local job holds: the supervisor claims them in a ledger
shared by every supervisor of this openlab home (``$OPENLAB_GPU_LEDGER``: a line ``GPU PID JOB PGID``
each, under ``fcntl.flock``; a claim is free once its supervisor and its job's process group are gone),
sets ``CUDA_VISIBLE_DEVICES`` to them and releases them when the job ends. Until enough are free the
job is PENDING, its reason naming the jobs that hold them, as a Slurm job waits for its GRES: two jobs
on one GPU would each run out of its memory. Its time limit and its start count from when it got them.

Stdlib only, imported by path with ``-S``, and only modules that need no Python-level
imports (``os``, ``sys``, ``time``, ``_signal``, ``resource``): it sits on every local job's critical
path, and ``json`` (``re``, ``enum``), ``socket`` and ``signal`` (``enum``) once cost
~30 ms of a ~45 ms start on a busy machine. Hence the hand-written JSON below, which only
has to encode a flat dict of strings, numbers and None.
"""

import os
import resource  # noqa: F401 - before any os.wait4, which imports it on its first call (see below)
import sys
import time

# os.wait4 imports ``resource`` (a C module, 0.7 ms) the first time it builds what a child used. The
# first wait4 is in the main thread, and a job that ends at once (CI: `readlink`, under load) sent its
# SIGCHLD in the middle of that import: the handler's own wait4 imported it again, and CPython 3.11's
# import lock, entered twice in one thread, failed with a KeyError traceback in place of the job.

try:  # the C module: ``signal`` itself wraps it in enums, and importing enum costs ~8 ms
    import _signal as signal
except ImportError:  # pragma: no cover - not CPython
    import signal

#: ``orchestrator.secrets``' rule (SECRET_NAME, MIN_SECRET_LENGTH, MASK), copied: this file imports
#: nothing of openlab. A variable is secret when its name has one of these words in it, in any case.
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
MIN_SECRET_LENGTH = 6
MASK = b"***"
#: A name in upper case as ``re.IGNORECASE`` reads the words: ASCII letters, and the four other
#: characters it takes for one of theirs (dotted and dotless i, long s, the Kelvin sign); nothing
#: else (``str.upper`` would make ``ß`` SS). ``re`` itself is not imported: it costs milliseconds.
_UPPER = str.maketrans("abcdefghijklmnopqrstuvwxyz\u0130\u0131\u017f\u212a", "ABCDEFGHIJKLMNOPQRSTUVWXYZIISK")
#: How long the end of a job may take to read what is left in the pipe, in seconds: a process that
#: left the job's group (or, under Slurm, outlives the command until Slurm ends it) may keep writing.
DRAIN_S = 1.0
#: Signals the ``--mask-output`` filter passes on or outlives: those the usage wrapper passes on.
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
#: ``--slurm-batch``: signals always passed on, never held against a SIGCONT (the usage wrapper's WARNINGS).
WARNINGS = ("SIGUSR1", "SIGUSR2")
#: ``--slurm-batch``: how close to a SIGCONT (seconds) a signal is Slurm ending the job, and how long
#: a signal is held before deciding (the usage wrapper's SLURM_END_WINDOW and HOLD).
SLURM_END_WINDOW = 1.0
HOLD = 0.1


#: Signals Python ignores at start, which a job is started with at their default (as a shell starts one).
RESTORED = tuple(getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, name))


def _rewrite_ledger(ledger, change):
    """Apply ``change`` to the live claims of ``ledger`` (``{gpu: [supervisor pid, job, job group]}``)
    under its lock and write them back; what ``change`` returns. A claim is live while its supervisor
    is, or the job's process group (a supervisor SIGKILLed by the OOM killer leaves its job running on
    the GPU until someone cancels it: giving that GPU to another job would run both out of its memory)."""
    import fcntl  # a C module, only for jobs that ask for GPUs

    with open(ledger, "a+", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        held = {}
        for line in fh.read().splitlines():
            parts = line.split("\t")
            if len(parts) == 3:  # written before the job started
                parts.append("")
            if len(parts) != 4 or not parts[1].isdigit():
                continue
            group = int(parts[3]) if parts[3].isdigit() else 0
            if alive(int(parts[1])) or (group and group_alive(group)):
                held[parts[0]] = parts[1:]
        result = change(held)
        fh.seek(0)
        fh.truncate()
        fh.write("".join(f"{gpu}\t{pid}\t{who}\t{group}\n" for gpu, (pid, who, group) in held.items()))
    return result


def claim_gpus(ledger, count, ids, job):
    """``count`` of the GPUs ``ids`` that no live claim holds, claimed for this supervisor in ``ledger``
    (module docstring); None, and who holds them (``{gpu: job}``), when fewer are free."""

    def claim(held):
        free = [gpu for gpu in ids if gpu not in held]
        mine = free[:count] if len(free) >= count else None
        for gpu in mine or ():
            held[gpu] = [str(os.getpid()), job, ""]
        return mine, {gpu: who for gpu, (_pid, who, _group) in held.items()}

    return _rewrite_ledger(ledger, claim)


def note_job_group(ledger, pgid):
    """Record the job's process group with this supervisor's claims: they stay while it runs."""

    def note(held):
        for claim in held.values():
            if claim[0] == str(os.getpid()):
                claim[2] = str(pgid)

    _rewrite_ledger(ledger, note)


def release_gpus(ledger):
    """Give back every GPU this supervisor holds in ``ledger``."""

    def release(held):
        for gpu in [gpu for gpu, claim in held.items() if claim[0] == str(os.getpid())]:
            del held[gpu]

    _rewrite_ledger(ledger, release)


def alive(pid):
    """Whether ``pid`` is a live process: a zombie is not (a supervisor SIGKILLed by the OOM killer stays
    one until its parent, the submitter, reaps it, which may be never: its claims then last only as long
    as its job's process group)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (not Linux): kill(0) said it is there
        return True


def group_members(pgid):
    """Live (non-zombie) processes of process group ``pgid``, from /proc: a job's process that outlived
    its supervisor may stay a zombie where nothing reaps orphans."""
    if not pgid:
        return []
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:
        pass
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def group_alive(pgid):
    """Whether any live process of group ``pgid`` is left."""
    return bool(group_members(pgid))


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


def secret_values(environ):
    """The values of ``environ``'s secret-named variables as bytes (as the job writes them), longest
    first: ``orchestrator.secrets.secret_values``, for a job's output."""
    found = set()
    for name, value in environ.items():
        if value and len(value) >= MIN_SECRET_LENGTH:
            upper = name.translate(_UPPER)
            for word in SECRET_WORDS:
                if word in upper:
                    found.add(os.fsencode(value))
                    break
    return sorted(found, key=len, reverse=True)


def masked(data, secrets, final=False):
    """``data`` with every secret value in it replaced by ``***``, as (what can be written now, what
    must wait for more): an end of ``data`` that a secret value begins with waits, unless ``final``,
    since the next read may complete it."""
    for secret in secrets:
        if secret in data:
            data = data.replace(secret, MASK)
    if final:
        return data, b""
    size, keep = len(data), 0
    for secret in secrets:
        first = secret[:1]
        at = data.find(first, max(size - len(secret) + 1, 0))
        while at != -1 and size - at > keep:
            if secret.startswith(data[at:]):
                keep = size - at
                break
            at = data.find(first, at + 1)
    return data[: size - keep], data[size - keep :]


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError:  # the log's disk is full or gone: the job goes on all the same, as it did
            return


def pump(pipe, secrets, ended):
    """Copy the pipe ``pipe["fd"]`` to standard output, masked (:func:`masked`), each chunk as it
    comes, until its end; once ``ended["at"]`` is set (the job's main process is gone, and the pipe
    made non-blocking) until it is empty, for at most :data:`DRAIN_S` seconds. Closes it."""
    held = b""
    while True:
        try:
            chunk = os.read(pipe["fd"], 65536)
        except OSError:  # BlockingIOError: the job ended and nothing is left to read
            break
        if not chunk:
            break
        out, held = masked(held + chunk, secrets)
        _write_all(1, out)
        if ended["at"] is not None and time.monotonic() - ended["at"] > DRAIN_S:
            break
    _write_all(1, masked(held, secrets, final=True)[0])
    fd, pipe["fd"] = pipe["fd"], None
    os.close(fd)


def _on_child_end(pid, ended, pipe, then=None):
    """A SIGCHLD handler: when ``pid["pid"]`` has exited, record how (``ended``), call ``then`` and
    make the pipe ``pipe["fd"]`` non-blocking, so :func:`pump` stops once it has read what is there."""

    def handler(_signum=None, _frame=None):
        if ended["at"] is not None or pid["pid"] is None:
            return
        try:
            done, status, usage = os.wait4(pid["pid"], os.WNOHANG)
        except ChildProcessError:  # reaped by _wait, which records how it ended
            return
        if not done:
            return
        ended.update(status=status, usage=usage, at=time.monotonic())
        if then is not None:
            then()
        if pipe["fd"] is not None:
            os.set_blocking(pipe["fd"], False)

    return handler


def _wait(pid, ended):
    """Wait for ``pid`` unless a SIGCHLD handler has reaped it; ``ended`` says how it ended."""
    while ended["at"] is None:
        try:  # wait4: the exit status and what the job used (it and every process it waited for)
            _, status, usage = os.wait4(pid, 0)
        except ChildProcessError:  # reaped by the handler meanwhile, or not ours
            if ended["at"] is None:
                ended.update(status=255 << 8, usage=None, at=time.monotonic())
            break
        ended.update(status=status, usage=usage, at=time.monotonic())


def _child_output(source, sink):
    """In the child: standard output and error to the pipe's ``sink``."""
    os.close(source)
    os.dup2(sink, 1)
    os.dup2(sink, 2)
    os.close(sink)


def main(argv):
    if argv and argv[0] == "--mask-output":
        return mask_output(argv[1:])
    run_path, limit, warn, grace, workdir = argv[0], float(argv[1]), float(argv[2]), float(argv[3]), argv[4]
    cmd = argv[6:] if argv[5] == "--" else argv[5:]

    why = {"stop": None, "killed": False, "pid": None, "warned": not 0 < warn < limit}
    # the job's own first process passes a graceful stop on (read here, not passed on to the job)
    first_only = os.environ.pop("OPENLAB_STOP_FIRST_PROCESS", "") == "1"
    secrets = secret_values(os.environ)
    ended = {"status": None, "usage": None, "at": None}
    gpus, ledger = os.environ.pop("OPENLAB_GPUS", ""), os.environ.pop("OPENLAB_GPU_LEDGER", "")

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
    if gpus and ledger:  # GPUs no other local job holds, waited for (module docstring)
        count, _, ids = gpus.partition(":")
        job = os.path.basename(run_path).split(".")[0]
        asked, waiting = int(count), False
        while True:
            mine, held = claim_gpus(ledger, asked, ids.split(","), job)
            if mine is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
                break
            if why["stop"] is not None:  # cancelled while it waited: it never ran
                _write(
                    run_path,
                    {"state": "CANCELLED", "reason": "cancelled while waiting for GPUs", "ended_at": time.time()},
                )
                return 0
            if not waiting:
                waiting = True
                holders = ", ".join(sorted(set(held.values())))
                reason = f"waiting for {asked} GPU(s) of {ids}: held by {holders}"
                _write(
                    run_path,
                    {"state": "PENDING", "reason": reason, "host": os.uname().nodename, "supervisor_pid": os.getpid()},
                )
            time.sleep(0.25)
    source = sink = None
    if secrets:  # the job's output through a pipe, masked on its way to the log (module docstring)
        source, sink = os.pipe()
        pipe = {"fd": source}
        # when the main process exits, nothing of the job outlives it: the group's pipe ends close too
        on_child = _on_child_end(why, ended, pipe, then=lambda: kill(signal.SIGKILL))
        signal.signal(signal.SIGCHLD, on_child)

    # Why the command could not start, if it could not: the child writes it here; the pipe is
    # close-on-exec, so a command that did start leaves it empty. Exit 127 alone cannot tell a
    # program that is not there from a program that exited 127 (as a shell does for its own).
    not_started, told = os.pipe()
    pid = os.fork()
    if pid == 0:  # the job, in its own process group (the supervisor already has its own session)
        os.close(not_started)
        os.setpgid(0, 0)
        # every signal at its default, as a shell starts a command: Python ignores SIGPIPE and SIGXFSZ,
        # and an ignored signal stays ignored across exec (`yes | head` printed "Broken pipe")
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM, signal.SIGCHLD, *RESTORED):
            signal.signal(sig, signal.SIG_DFL)
        if sink is not None:
            _child_output(source, sink)
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
    if sink is not None:
        os.close(sink)
    try:  # set it from both sides, so the group exists before anyone signals it
        os.setpgid(pid, pid)
    except OSError:
        pass
    why["pid"] = pid
    if gpus and ledger:
        note_job_group(ledger, pid)
    if why["stop"] is not None:
        kill(signal.SIGTERM)

    # its own pid too: a submitter killed before it put that in ID.json leaves only this to cancel by
    state = {
        "state": "RUNNING",
        "pgid": pid,
        "host": os.uname().nodename,
        "started_at": time.time(),
        "supervisor_pid": os.getpid(),
    }
    _write(run_path, state)
    if limit > 0:
        signal.setitimer(signal.ITIMER_REAL, limit - warn if 0 < warn < limit else limit)

    if source is not None:
        on_child()  # it may have ended before its pid was known
        pump(pipe, secrets, ended)
    _wait(pid, ended)
    status, usage = ended["status"], ended["usage"]
    signal.setitimer(signal.ITIMER_REAL, 0)
    try:  # nothing of the job outlives it
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    if gpus and ledger:
        release_gpus(ledger)

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


def mask_output(argv):
    """``--mask-output (--slurm-batch | --no-forward) -- CMD...``: CMD's output masked (module docstring)."""
    if len(argv) < 3 or argv[0] not in ("--slurm-batch", "--no-forward") or argv[1] != "--":
        sys.stderr.write("usage: python -I -S _supervise.py --mask-output (--slurm-batch | --no-forward) -- CMD...\n")
        return 2
    slurm_batch, cmd = argv[0] == "--slurm-batch", argv[2:]
    secrets = secret_values(os.environ)
    if not secrets:  # nothing to mask: be CMD
        try:
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            sys.stderr.write(f"openlab: cannot run {cmd[0]!r}: {exc.strerror}\n")
            return 127
    child = {"pid": None}
    ended = {"status": None, "usage": None, "at": None}
    pending = []  # signals that came before CMD existed
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

    warnings = {getattr(signal, name) for name in WARNINGS if hasattr(signal, name)}

    def forward(signum, _frame):
        if slurm_batch and signum in warnings:  # for the batch shell alone, whatever SIGCONT comes with it
            send(signum)
        elif slurm_batch:  # decide once a SIGCONT that came with it has been seen (module docstring)
            held.append((signum, time.monotonic()))
            signal.setitimer(signal.ITIMER_REAL, HOLD)
        # --no-forward: CMD got it too; outlive it, nothing more

    def on_cont(_signum, _frame):
        cont["at"] = time.monotonic()

    def decide(_signum, _frame):
        while held:
            signum, at = held.pop(0)
            if cont["at"] is None or abs(at - cont["at"]) > SLURM_END_WINDOW:  # for the batch shell alone
                send(signum)

    sigs = [getattr(signal, name) for name in FORWARDED if hasattr(signal, name)]
    for sig in sigs:
        signal.signal(sig, forward)
    if slurm_batch:
        signal.signal(signal.SIGCONT, on_cont)
        signal.signal(signal.SIGALRM, decide)
    source, sink = os.pipe()
    pipe = {"fd": source}
    on_child = _on_child_end(child, ended, pipe)
    signal.signal(signal.SIGCHLD, on_child)
    pid = os.fork()
    if pid == 0:
        # every signal as a command started by a shell has it (Python ignores SIGPIPE and SIGXFSZ)
        for sig in [*sigs, *RESTORED, signal.SIGCONT, signal.SIGALRM, signal.SIGCHLD]:
            signal.signal(sig, signal.SIG_DFL)
        _child_output(source, sink)
        try:
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            sys.stderr.write(f"openlab: cannot run {cmd[0]!r}: {exc.strerror}\n")
            sys.stderr.flush()
            os._exit(127)
    os.close(sink)
    child["pid"] = pid
    for sig in pending:
        send(sig)
    on_child()  # it may have ended before its pid was known
    pump(pipe, secrets, ended)
    _wait(pid, ended)
    status = ended["status"]
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)  # as the usage wrapper and a shell say it
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
