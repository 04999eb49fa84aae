"""github digest: the one daily-digest comment per experiment issue and UTC day

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 09:00:00

Written by hand for ``GithubDigest`` in :mod:`orchestrator.lineage.models` (``openlab github digest``).
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "githubdigest",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("issue_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("day", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("window_start", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("window_end", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("pipeline_run_ids", sa.JSON(), nullable=True),
        sa.Column("comment_id", sa.BigInteger(), nullable=True),
        sa.Column("url", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("body_hash", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("updated_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("githubdigest", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_githubdigest_issue_id"), ["issue_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_githubdigest_day"), ["day"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("githubdigest", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_githubdigest_day"))
        batch_op.drop_index(batch_op.f("ix_githubdigest_issue_id"))
    op.drop_table("githubdigest")
