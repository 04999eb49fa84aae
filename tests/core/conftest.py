"""Store fixtures: every store test runs on real SQLite and, where it is up, real PostgreSQL."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from orchestrator.lineage import LineageStore


def _postgres_admin_url() -> str:
    from tests.services import postgres_url

    return postgres_url()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(
    request: pytest.FixtureRequest, openlab_home: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LineageStore]:
    if request.param == "sqlite":
        store = LineageStore(f"sqlite:///{openlab_home / 'lineage.db'}")
        yield store
        store.close()
        return
    admin_url = _postgres_admin_url()  # skips (or fails under CI) when PostgreSQL is not up
    name = f"openlab_t_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.engine.make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    monkeypatch.setenv("OPENLAB_DB_URL", url)
    store = LineageStore(url)
    try:
        yield store
    finally:
        store.close()
        _drop_database(admin, name)
        admin.dispose()


def _drop_database(admin: sa.Engine, name: str) -> None:
    """Drop a test database. FORCE ends this role's leftover connections; an autovacuum worker
    that happens to be visiting the new database belongs to no role this one may signal, so the
    drop is refused until it leaves (it does within moments): try again for a while."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            return
        except sa.exc.ProgrammingError as exc:
            if "pg_signal_backend" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
