"""pipeline run preregistration: a recipe's predictions checked against the run

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04 17:25:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pipelinerun", schema=None) as batch_op:
        batch_op.add_column(sa.Column("preregistration", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("pipelinerun", schema=None) as batch_op:
        batch_op.drop_column("preregistration")
