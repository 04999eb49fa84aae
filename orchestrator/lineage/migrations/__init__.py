"""Schema migrations (Alembic), applied automatically when a store is opened.

Newer code against an older database upgrades it in place, inside one transaction.
Older code against a newer database refuses: it cannot know what the newer schema
means, and writing to it could corrupt lineage that others rely on.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from orchestrator.errors import StoreError

MIGRATIONS_DIR = Path(__file__).parent
_PG_MIGRATE_LOCK = 0x6F6C6D6967  # serialises concurrent first opens on PostgreSQL


def _alembic_config(connection: sa.Connection | None = None):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def known_revisions() -> tuple[set[str], str]:
    """All revisions this code knows, and its head."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(_alembic_config())
    head = script.get_current_head()
    assert head is not None
    return {rev.revision for rev in script.walk_revisions()}, head


def _current_revisions(conn: sa.Connection) -> set[str]:
    if not sa.inspect(conn).has_table("alembic_version"):
        return set()
    return {row[0] for row in conn.execute(sa.text("SELECT version_num FROM alembic_version"))}


def head_revision() -> str:
    """The newest schema revision this code knows (read from the version files' names)."""
    return max(p.stem.split("_", 1)[0] for p in (MIGRATIONS_DIR / "versions").glob("[0-9]*_*.py"))


def ensure_schema(engine: Engine, *, migrate: bool = True) -> None:
    """Bring the database to this code's schema, or refuse if the database is newer."""
    with engine.connect() as conn:
        current = _current_revisions(conn)
        conn.rollback()
    head = head_revision()
    if current == {head}:
        return
    known, head = known_revisions()
    unknown = current - known
    if unknown:
        raise StoreError(
            f"lineage database schema {', '.join(sorted(unknown))} is newer than this openlab "
            f"(knows up to {head}); upgrade openlab to use this database"
        )
    if not migrate:
        raise StoreError(f"lineage database needs migration to {head}; open it with migrations enabled")
    from alembic import command

    with engine.connect() as conn:
        conn.info["write"] = True
        with conn.begin():
            if engine.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATE_LOCK})
            command.upgrade(_alembic_config(conn), "head")
        conn.info.pop("write", None)
