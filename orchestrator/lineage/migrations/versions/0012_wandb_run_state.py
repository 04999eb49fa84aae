"""wandb run state: how the W&B run ended (finished, failed, preempted, crashed), read from its files

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05 15:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("wandbrun", schema=None) as batch_op:
        batch_op.add_column(sa.Column("state", sqlmodel.sql.sqltypes.AutoString(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("wandbrun", schema=None) as batch_op:
        batch_op.drop_column("state")
