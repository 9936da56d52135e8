"""experiments: notes, Determined's free text beside the description (``Experiment.set_notes``)

Shown by `det e describe` (and its --json). Existing experiments have none (NULL).

Revision ID: 0005_notes
Revises: 0003_preempt2
Create Date: 2026-11-29 12:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005_notes"
down_revision = "0003_preempt2"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("experiments", schema=None) as batch_op:
        batch_op.add_column(sa.Column("notes", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("experiments", schema=None) as batch_op:
        batch_op.drop_column("notes")
