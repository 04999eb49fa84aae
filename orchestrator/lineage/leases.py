"""Leases: at most one holder executes a stage identity at a time, across processes and machines.

A lease is a row in the ``lease`` table keyed by the stage identity. Why a database row
and not a file lock: the lineage database is the one thing every process (and, with
PostgreSQL, every machine) running a pipeline already shares, and a row with an expiry
survives a crashed holder — after ``expires_at`` anyone may take it over (Marin's
executor does the same with a status file: heartbeat every 30 s, stale after 90 s).

Atomicity comes from one statement, on SQLite and PostgreSQL alike::

    INSERT INTO lease (...) VALUES (...)
    ON CONFLICT (identity) DO UPDATE SET holder = excluded.holder, ...
    WHERE lease.expires_at < :now OR lease.holder = :holder

followed, in the same write transaction, by reading the row back: the caller holds the
lease exactly when the row names it. A heartbeat is ``UPDATE ... WHERE identity = ? AND
holder = ?``; zero rows updated means the lease was taken over, and the holder must stop
(:class:`HeldLease` sets :attr:`HeldLease.lost`, which the pipeline feeds to the
launcher's ``should_cancel`` so the job is cancelled — Marin #5026, #8107: a holder that
lost its lease kept running a duplicate step).

Leases are coordination state, not lineage: they change without events. Times are the
holders' UTC clocks; keep machines within a few seconds of each other (NTP) and the TTL
much longer than that.

A holder that is provably gone does not keep its identity for the rest of the TTL. Each row
records the process that took it (:func:`process_mark`: the kernel's boot id, the PID namespace,
the pid and the process's start time). A reader on the same boot and in the same PID namespace
can see whether that process still exists; when it does not (SIGKILL, the OOM killer, a crash)
the lease is not live, so a re-run takes the identity over at once and ``openlab lineage
reconcile`` frees its job at once, instead of 90 s later. From another machine, container or
boot nothing is provable, and the expiry decides as before.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect

from orchestrator.lineage.models import Lease, utcnow
from orchestrator.lineage.store import LineageStore

log = logging.getLogger(__name__)

#: Defaults after Marin's executor: heartbeat every 30 s, stale after 90 s.
DEFAULT_TTL = 90.0
DEFAULT_HEARTBEAT = 30.0


def new_holder(tag: str = "") -> str:
    """A holder name unique to this acquisition: host, pid, a tag and a random suffix."""
    suffix = uuid.uuid4().hex[:8]
    return f"{socket.gethostname()}:{os.getpid()}:{tag + ':' if tag else ''}{suffix}"


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def start_ticks(pid: int) -> int | None:
    """A process's start time (clock ticks since boot, field 22 of /proc/PID/stat), or None when it
    is gone, a zombie (dead, waiting for its parent to reap it), or this is not Linux. With the pid it
    names one process: a pid alone may have been given to another since (a lease's holder, the
    Prefect server an ``openlab server`` left)."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    return int(fields[19]) if len(fields) > 19 and fields[0] != "Z" else None


def _boot_and_namespace() -> tuple[str, str] | None:
    boot = _read_text("/proc/sys/kernel/random/boot_id")
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None
    return (boot.strip(), namespace) if boot else None


def process_mark(pid: int | None = None) -> str | None:
    """``boot id/PID namespace/pid/start ticks`` of a process (this one by default); None off Linux.

    The start time tells a reused pid from the holder; the boot id and namespace say whether a
    reader can look the holder up at all (the init namespace's inode is the same on every machine).
    """
    where = _boot_and_namespace()
    pid = os.getpid() if pid is None else pid
    start = start_ticks(pid)
    if where is None or start is None:
        return None
    return f"{where[0]}/{where[1]}/{pid}/{start}"


def holder_gone(lease: Lease | None) -> bool:
    """Whether the process that holds ``lease`` provably no longer runs (same boot and PID
    namespace as this process, and its pid is gone or now names a younger process)."""
    if lease is None or not lease.process:
        return False
    parts = lease.process.split("/")
    where = _boot_and_namespace()
    if len(parts) != 4 or where is None or (parts[0], parts[1]) != where or not parts[2].isdigit():
        return False
    return str(start_ticks(int(parts[2]))) != parts[3]


def _write(store: LineageStore) -> Any:
    """A connection whose transaction takes SQLite's write lock at BEGIN (see the store)."""
    conn = store.engine.connect()
    conn.info["write"] = True
    return conn


def _insert(store: LineageStore) -> Any:
    if store.engine.dialect.name == "postgresql":
        return pg_dialect.insert(Lease)
    return sqlite_dialect.insert(Lease)


def acquire(
    store: LineageStore,
    identity: str,
    holder: str,
    *,
    ttl: float = DEFAULT_TTL,
    stage_run_id: str | None = None,
    gone: str | None = None,
) -> bool:
    """Take the lease on ``identity`` for ``holder`` if it is free, expired or already ours, or
    held by ``gone`` (a holder :func:`holder_gone` judged dead: taken only if it still holds it)."""
    now = utcnow()
    expires = now + dt.timedelta(seconds=ttl)
    table = Lease.__table__  # type: ignore[attr-defined]
    stmt = _insert(store).values(
        identity=identity,
        holder=holder,
        stage_run_id=stage_run_id,
        acquired_at=now,
        heartbeat_at=now,
        expires_at=expires,
        process=process_mark(),
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[table.c.identity],
        set_={
            "holder": stmt.excluded.holder,
            "stage_run_id": stmt.excluded.stage_run_id,
            "acquired_at": stmt.excluded.acquired_at,
            "heartbeat_at": stmt.excluded.heartbeat_at,
            "expires_at": stmt.excluded.expires_at,
            "process": stmt.excluded.process,
        },
        where=sa.or_(table.c.expires_at < now, table.c.holder == holder, *([table.c.holder == gone] if gone else [])),
    )
    conn = _write(store)
    try:
        with conn.begin():
            conn.execute(stmt)
            row = conn.execute(sa.select(table.c.holder).where(table.c.identity == identity)).first()
    finally:
        conn.info.pop("write", None)
        conn.close()
    return row is not None and row[0] == holder


def heartbeat(store: LineageStore, identity: str, holder: str, *, ttl: float = DEFAULT_TTL) -> bool:
    """Extend our lease; False when it is no longer ours (taken over after it expired, or released)."""
    now = utcnow()
    table = Lease.__table__  # type: ignore[attr-defined]
    conn = _write(store)
    try:
        with conn.begin():
            result = conn.execute(
                sa.update(table)
                .where(table.c.identity == identity, table.c.holder == holder)
                .values(heartbeat_at=now, expires_at=now + dt.timedelta(seconds=ttl))
            )
    finally:
        conn.info.pop("write", None)
        conn.close()
    return bool(result.rowcount)


def release(store: LineageStore, identity: str, holder: str) -> bool:
    """Give the lease up (only if it is still ours); True when a row was removed."""
    table = Lease.__table__  # type: ignore[attr-defined]
    conn = _write(store)
    try:
        with conn.begin():
            result = conn.execute(sa.delete(table).where(table.c.identity == identity, table.c.holder == holder))
    finally:
        conn.info.pop("write", None)
        conn.close()
    return bool(result.rowcount)


def current(store: LineageStore, identity: str) -> Lease | None:
    """The lease row for ``identity`` (live or expired), or None."""
    return store.get(Lease, identity)


def is_live(lease: Lease | None, now: dt.datetime | None = None) -> bool:
    """Whether a lease row still protects its identity (exists, has not expired, and its holder's
    process is not provably gone)."""
    if lease is None:
        return False
    expires = lease.expires_at
    if expires.tzinfo is None:
        expires = expires.replace(tzinfo=dt.UTC)
    return expires >= (now or utcnow()) and not holder_gone(lease)


class HeldLease:
    """A lease we hold, kept alive by a heartbeat thread until :meth:`release`.

    ``lost`` is set when a heartbeat finds the lease taken over; ``should_cancel()``
    returns True from then on, and ``on_lost`` (if given) is called once from the
    heartbeat thread. Use as a context manager to release on exit.
    """

    def __init__(
        self,
        store: LineageStore,
        identity: str,
        holder: str,
        *,
        ttl: float = DEFAULT_TTL,
        heartbeat_interval: float | None = None,
        on_lost: Callable[[HeldLease], None] | None = None,
    ) -> None:
        self.store = store
        self.identity = identity
        self.holder = holder
        self.ttl = ttl
        self.interval = heartbeat_interval if heartbeat_interval is not None else max(0.05, ttl / 3)
        self.on_lost = on_lost
        self.lost = threading.Event()
        self.lost_reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HeldLease:
        """Start heartbeating (call once the lease has been acquired)."""
        self._thread = threading.Thread(target=self._run, name=f"lease-{self.identity[:12]}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                ok = heartbeat(self.store, self.identity, self.holder, ttl=self.ttl)
            except Exception as exc:  # noqa: BLE001 - a flaky database must not kill the holder at once
                log.warning("lease heartbeat for %s failed: %s", self.identity[:16], exc)
                continue
            if not ok:
                other = current(self.store, self.identity)
                self.lost_reason = (
                    f"lease on identity {self.identity[:16]} was taken over by {other.holder}"
                    if other is not None
                    else f"lease on identity {self.identity[:16]} disappeared"
                )
                log.warning("%s; cancelling our job", self.lost_reason)
                self.lost.set()
                if self.on_lost is not None:
                    try:
                        self.on_lost(self)
                    except Exception:  # noqa: BLE001
                        log.exception("on_lost callback failed")
                return

    def should_cancel(self) -> bool:
        """True once the lease is lost: the job must stop, someone else owns this identity now."""
        return self.lost.is_set()

    def release(self) -> None:
        """Stop heartbeating and give the lease up (a no-op if it was taken over)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if not self.lost.is_set():
            try:
                release(self.store, self.identity, self.holder)
            except Exception as exc:  # noqa: BLE001 - the lease expires on its own
                log.warning("could not release lease %s: %s", self.identity[:16], exc)

    def __enter__(self) -> HeldLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def try_hold(
    store: LineageStore,
    identity: str,
    holder: str,
    *,
    ttl: float = DEFAULT_TTL,
    heartbeat_interval: float | None = None,
    stage_run_id: str | None = None,
    on_lost: Callable[[HeldLease], None] | None = None,
) -> HeldLease | None:
    """Acquire and start heartbeating, or None when another live holder has the identity."""
    if not acquire(store, identity, holder, ttl=ttl, stage_run_id=stage_run_id):
        other = current(store, identity)
        if other is None or not holder_gone(other):
            return None
        if not acquire(store, identity, holder, ttl=ttl, stage_run_id=stage_run_id, gone=other.holder):
            return None
        log.info("took over %s from %s: its process is gone", identity[:24], other.holder)
    return HeldLease(store, identity, holder, ttl=ttl, heartbeat_interval=heartbeat_interval, on_lost=on_lost).start()


def set_stage_run(store: LineageStore, identity: str, holder: str, stage_run_id: str) -> bool:
    """Record which stage run a held lease protects (reconcile reads it)."""
    table = Lease.__table__  # type: ignore[attr-defined]
    conn = _write(store)
    try:
        with conn.begin():
            result = conn.execute(
                sa.update(table)
                .where(table.c.identity == identity, table.c.holder == holder)
                .values(stage_run_id=stage_run_id)
            )
    finally:
        conn.info.pop("write", None)
        conn.close()
    return bool(result.rowcount)


__all__ = [
    "DEFAULT_HEARTBEAT",
    "DEFAULT_TTL",
    "HeldLease",
    "acquire",
    "current",
    "heartbeat",
    "holder_gone",
    "is_live",
    "new_holder",
    "process_mark",
    "release",
    "set_stage_run",
    "try_hold",
]
