"""read indexes: experiments by owner, executor and state; metrics by trial and step

Every read command with no daemon running first asks whether the caller has an unfinished
experiment of an executor (views.has_unfinished); with thousands of ended experiments that was
a scan of the whole table on every `det` call. This index answers it from the index alone.
`det e describe` shows each trial's latest reports, and a trial's batches is its highest step:
with a million metric rows, both read the end of the (trial, step) index instead of sorting.

Revision ID: 0004_cli15
Revises: 0003_dashboard
Create Date: 2026-11-23 13:00:00
"""

from alembic import op

revision = "0004_cli15"
down_revision = "0003_dashboard"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("experiments", schema=None) as batch_op:
        batch_op.create_index("ix_experiments_owner_executor_state", ["owner", "executor", "state"], unique=False)
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.create_index("ix_metrics_trial_steps", ["trial_id", "steps_completed"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.drop_index("ix_metrics_trial_steps")
    with op.batch_alter_table("experiments", schema=None) as batch_op:
        batch_op.drop_index("ix_experiments_owner_executor_state")
