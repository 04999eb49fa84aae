"""Alembic environment: runs on the connection that :func:`ensure_schema` hands over."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

import orchestrator.lineage.models  # noqa: F401  (registers the tables on SQLModel.metadata)

connection = context.config.attributes.get("connection")
if connection is None:  # e.g. `alembic revision --autogenerate` from a developer shell
    from orchestrator.lineage.store import _make_engine, _normalise_url
    from orchestrator.settings import load_settings

    engine = _make_engine(_normalise_url(load_settings().db_url))
    connection = engine.connect()

context.configure(
    connection=connection,
    target_metadata=SQLModel.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
    transactional_ddl=True,
)
context.run_migrations()
