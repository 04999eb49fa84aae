"""pipeline run error message

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 19:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pipelinerun", schema=None) as batch_op:
        batch_op.add_column(sa.Column("error", sqlmodel.sql.sqltypes.AutoString(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("pipelinerun", schema=None) as batch_op:
        batch_op.drop_column("error")
