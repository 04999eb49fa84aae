"""Store fixtures: every store test runs on real SQLite and, where it is up, real PostgreSQL."""

from __future__ import annotations

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
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
