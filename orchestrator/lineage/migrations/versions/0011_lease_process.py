"""lease process: the holder's process, so a lease whose holder is gone stops protecting at once

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05 05:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("lease", schema=None) as batch_op:
        batch_op.add_column(sa.Column("process", sqlmodel.sql.sqltypes.AutoString(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("lease", schema=None) as batch_op:
        batch_op.drop_column("process")
