"""attempt progress_saved: a stopped job that saved its checkpoint, which the next attempt went on from

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 14:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempt", schema=None) as batch_op:
        batch_op.add_column(sa.Column("progress_saved", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempt", schema=None) as batch_op:
        batch_op.drop_column("progress_saved")
