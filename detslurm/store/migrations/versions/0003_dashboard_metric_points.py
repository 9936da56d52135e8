"""metric_points: numeric metric values unpacked for the dashboard's curves

Every numeric value of every stored report becomes a row (trial, group, name, step, time,
value, archived) with a covering index on (trial, group, name, archived, step, value, time): the dashboard
reads a curve of a large search as an index range instead of parsing each report's JSON. Existing reports are
unpacked here, in SQL (json_each), so an upgraded store shows its old curves too.

Revision ID: 0003_dashboard
Revises: 0003_verbs
Create Date: 2026-11-23 12:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_dashboard"
down_revision = "0003_verbs"
branch_labels = None
depends_on = None

_BACKFILL_SQLITE = """
INSERT INTO metric_points (trial_id, "group", name, steps_completed, report_time, value, archived)
SELECT m.trial_id, m."group", j.key, m.steps_completed, m.report_time, j.value, m.archived
FROM metrics AS m, json_each(m.metrics) AS j
WHERE j.type IN ('integer', 'real') AND length(j.key) <= 256
"""
_BACKFILL_POSTGRES = """
INSERT INTO metric_points (trial_id, "group", name, steps_completed, report_time, value, archived)
SELECT m.trial_id, m."group", j.key, m.steps_completed, m.report_time, (j.value #>> '{}')::float8, m.archived
FROM metrics AS m, json_each(m.metrics) AS j
WHERE json_typeof(j.value) = 'number' AND length(j.key) <= 256
"""


def upgrade() -> None:
    op.create_table(
        "metric_points",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("group", sa.String(length=256), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("steps_completed", sa.BigInteger(), nullable=False),
        sa.Column("report_time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("archived", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["trial_id"], ["trials.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_metric_points_curve",
        "metric_points",
        ["trial_id", "group", "name", "archived", "steps_completed", "value", "report_time"],
        unique=False,
    )
    bind = op.get_bind()
    op.execute(_BACKFILL_POSTGRES if bind.dialect.name == "postgresql" else _BACKFILL_SQLITE)


def downgrade() -> None:
    op.drop_index("ix_metric_points_curve", table_name="metric_points")
    op.drop_table("metric_points")
