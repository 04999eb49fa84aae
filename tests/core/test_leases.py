"""Leases whose holder is provably gone stop protecting their identity at once (real processes, real
SQLite and PostgreSQL); a holder that may be alive keeps it until its lease expires."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.lineage import LineageStore, leases
from orchestrator.lineage.models import Lease, utcnow

ROOT = Path(__file__).resolve().parents[2]

HOLD = """
import sys
from orchestrator.lineage import LineageStore, leases
store = LineageStore(sys.argv[1])
assert leases.acquire(store, sys.argv[2], "holder-" + sys.argv[2], ttl=600)
print("held", flush=True)
sys.stdin.readline()  # hold until told (or killed)
"""


def _holder(store: LineageStore, identity: str) -> subprocess.Popen[str]:
    url = store.engine.url.render_as_string(hide_password=False)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, url, identity],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_killed_holders_lease_is_taken_over_at_once_and_a_live_ones_is_not(store: LineageStore) -> None:
    """A holder killed outright (SIGKILL, the OOM killer) leaves a row that expires in ten minutes: it
    protects nothing, and the next run takes the identity at once. While the holder lives it keeps it."""
    proc = _holder(store, "i-held")
    try:
        row = leases.current(store, "i-held")
        assert row is not None and row.process and row.process.endswith(f"/{proc.pid}/" + row.process.split("/")[3])
        assert leases.is_live(row) and not leases.holder_gone(row)
        assert leases.try_hold(store, "i-held", "me") is None, "a live holder keeps its identity"
        proc.kill()
        deadline = time.monotonic() + 20
        while not leases.holder_gone(row):  # killed, not yet reaped: a zombie is gone too
            assert time.monotonic() < deadline, "a killed, unreaped holder still counts as alive"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    row = leases.current(store, "i-held")
    assert row is not None and row.holder == "holder-i-held"
    assert row.expires_at.replace(tzinfo=dt.UTC) > utcnow() + dt.timedelta(minutes=5), "the row has not expired"
    assert leases.holder_gone(row) and not leases.is_live(row)
    held = leases.try_hold(store, "i-held", "me", ttl=600)
    assert held is not None, "a gone holder's identity is taken over at once"
    try:
        now = leases.current(store, "i-held")
        assert now is not None and now.holder == "me" and now.process == leases.process_mark()
        assert leases.is_live(now), "and the new holder, alive, holds it"
    finally:
        held.release()


def test_a_holder_that_cannot_be_looked_up_keeps_its_lease_until_it_expires(store: LineageStore) -> None:
    """A holder on another machine or boot (or a row written before processes were recorded) may be
    alive: only its expiry frees the identity. A pid that now names a younger process is not the holder."""
    mine = leases.process_mark()
    assert mine is not None
    boot, namespace, pid, start = mine.split("/")
    later = utcnow() + dt.timedelta(minutes=10)
    with store.transaction() as tx:
        tx.session.add(
            Lease(identity="i-elsewhere", holder="b", expires_at=later, process=f"other-boot/{namespace}/1/1")
        )
        tx.session.add(Lease(identity="i-old-row", holder="c", expires_at=later, process=None))
        tx.session.add(Lease(identity="i-reused", holder="d", expires_at=later, process=f"{boot}/{namespace}/{pid}/1"))
    for identity in ("i-elsewhere", "i-old-row"):
        row = leases.current(store, identity)
        assert leases.is_live(row) and not leases.holder_gone(row), identity
        assert leases.try_hold(store, identity, "me") is None, identity
    reused = leases.current(store, "i-reused")
    assert start != "1" and leases.holder_gone(reused), "our pid with another start time is a gone holder"
    held = leases.try_hold(store, "i-reused", "me")
    assert held is not None
    held.release()
