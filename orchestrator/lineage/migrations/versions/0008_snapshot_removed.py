"""datasnapshot removed_at / removed_reason: a snapshot's folder replaced by a forced re-run

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05 02:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("datasnapshot", schema=None) as batch_op:
        batch_op.add_column(sa.Column("removed_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True))
        batch_op.add_column(sa.Column("removed_reason", sqlmodel.sql.sqltypes.AutoString(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("datasnapshot", schema=None) as batch_op:
        batch_op.drop_column("removed_reason")
        batch_op.drop_column("removed_at")
