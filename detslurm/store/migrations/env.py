"""Alembic environment: always run programmatically by detslurm.store.db with a connection."""

from __future__ import annotations

from alembic import context

from detslurm.store.models import Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:  # pragma: no cover - only reached via the alembic command line
    raise RuntimeError("run migrations through detslurm.store.db.Store.migrate()")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=True,  # SQLite cannot ALTER most things; batch mode copies the table
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
