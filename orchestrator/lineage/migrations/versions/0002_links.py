"""GitHub links: the per-run card comment and the queue of pending GitHub updates

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 19:00:00

Written by hand (the links work) for ``GithubComment`` and ``GithubUpdate`` in
:mod:`orchestrator.lineage.models`; regenerate with autogenerate if preferred.
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "githubcomment",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("issue_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("pipeline_run_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("comment_id", sa.BigInteger(), nullable=True),
        sa.Column("url", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("body_hash", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("updated_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("githubcomment", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_githubcomment_issue_id"), ["issue_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_githubcomment_pipeline_run_id"), ["pipeline_run_id"], unique=False)

    op.create_table(
        "githubupdate",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("action", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("issue_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("pipeline_run_id", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("state", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("not_before", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("updated_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("githubupdate", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_githubupdate_issue_id"), ["issue_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_githubupdate_pipeline_run_id"), ["pipeline_run_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_githubupdate_state"), ["state"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("githubupdate", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_githubupdate_state"))
        batch_op.drop_index(batch_op.f("ix_githubupdate_pipeline_run_id"))
        batch_op.drop_index(batch_op.f("ix_githubupdate_issue_id"))
    op.drop_table("githubupdate")
    with op.batch_alter_table("githubcomment", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_githubcomment_pipeline_run_id"))
        batch_op.drop_index(batch_op.f("ix_githubcomment_issue_id"))
    op.drop_table("githubcomment")
