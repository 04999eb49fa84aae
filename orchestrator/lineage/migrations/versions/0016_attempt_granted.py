"""attempt granted: what the backend gave the job (Slurm's allocated TRES), where it differs from what it asked

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 22:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempt", schema=None) as batch_op:
        batch_op.add_column(sa.Column("granted", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempt", schema=None) as batch_op:
        batch_op.drop_column("granted")
