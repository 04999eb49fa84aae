"""run user and command: who started a pipeline run and what they typed; who submitted a job

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05 22:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pipelinerun", schema=None) as batch_op:
        batch_op.add_column(sa.Column("user", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        batch_op.add_column(sa.Column("command", sa.JSON(), nullable=True))
        batch_op.create_index(batch_op.f("ix_pipelinerun_user"), ["user"], unique=False)
    with op.batch_alter_table("attempt", schema=None) as batch_op:
        batch_op.add_column(sa.Column("user", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        batch_op.create_index(batch_op.f("ix_attempt_user"), ["user"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("attempt", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_attempt_user"))
        batch_op.drop_column("user")
    with op.batch_alter_table("pipelinerun", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_pipelinerun_user"))
        batch_op.drop_column("command")
        batch_op.drop_column("user")
