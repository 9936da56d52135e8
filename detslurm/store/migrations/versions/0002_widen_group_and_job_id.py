"""widen metrics.group to 256 and trial_runs.job_id to text

PostgreSQL enforces VARCHAR lengths (SQLite does not): a metric group of more than 64 characters
or a ``--local`` job id (it holds a path) of more than 128 failed there.
The group keeps a bound, enforced at ingest by detslurm.store.sanitize.metric_group.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 09:15:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.alter_column(
            "group", existing_type=sa.String(length=64), type_=sa.String(length=256), existing_nullable=False
        )
    with op.batch_alter_table("trial_runs", schema=None) as batch_op:
        batch_op.alter_column("job_id", existing_type=sa.String(length=128), type_=sa.Text(), existing_nullable=True)


def downgrade() -> None:
    with op.batch_alter_table("trial_runs", schema=None) as batch_op:
        batch_op.alter_column("job_id", existing_type=sa.Text(), type_=sa.String(length=128), existing_nullable=True)
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.alter_column(
            "group", existing_type=sa.String(length=256), type_=sa.String(length=64), existing_nullable=False
        )
