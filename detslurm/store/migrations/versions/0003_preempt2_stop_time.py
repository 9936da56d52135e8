"""trial_runs: when Slurm's stop signal reached the trial, and its measured stop time

The time from the signal to the acknowledged checkpoint is compared with the site's budget
(GraceTime, KillWait, the warning signal's lead; docs/design/preemption.md).

Revision ID: 0003_preempt2
Revises: 0004_cli15
Create Date: 2026-11-23 12:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_preempt2"
down_revision = "0004_cli15"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("trial_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("preempt_signal_time", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("preempt_stop_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trial_runs", schema=None) as batch_op:
        batch_op.drop_column("preempt_stop_s")
        batch_op.drop_column("preempt_signal_time")
