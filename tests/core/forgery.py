"""Forging lineage as someone who controls the database would: for the tests of what catches it."""

from __future__ import annotations

from typing import Any

from sqlmodel import Session, col, select

from orchestrator.lineage.models import RECORD_TYPES, Event
from orchestrator.lineage.store import GENESIS_HASH, LineageStore, event_hash


def rewrite_whole_log(store: LineageStore, kind: str, record_id: str, **changes: Any) -> None:
    """Change a record's fields in its row and in every event of it, then recompute every event's
    hash and link in order, so the chain and the rows agree again: what ``lineage verify``'s chain
    and record checks cannot tell from the real thing."""
    with Session(store.engine) as session:
        row = session.get(RECORD_TYPES[kind], record_id)
        assert row is not None, f"no {kind} {record_id}"
        for name, value in changes.items():
            setattr(row, name, value)
        session.add(row)
        prev = GENESIS_HASH
        for ev in session.exec(select(Event).order_by(col(Event.seq))).all():
            if ev.record_id == record_id:
                ev.payload = {**ev.payload, **changes}
            ev.prev_hash = prev
            ev.hash = prev = event_hash(ev.seq, ev.at, ev.record_kind, ev.record_id, ev.action, ev.payload, prev)
            session.add(ev)
        session.commit()
