"""poll_stamps: when a read command last polled Slurm for each user

With no daemon running, every read command (`det e list`, `det t logs`, ...) does one reconcile
step, which queries Slurm. The time of the last one is kept per user, so reads in quick
succession reuse it instead of polling faster than the site's poll_interval_s.

Revision ID: 0003_verbs
Revises: 0002
Create Date: 2026-11-23 12:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_verbs"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "poll_stamps",
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("last_poll", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner"),
    )


def downgrade() -> None:
    op.drop_table("poll_stamps")
