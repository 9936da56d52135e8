"""Row-level security for a shared PostgreSQL store (docs/admin/postgres.md).

Without it, detslurm keeps users apart in the client: anyone with the database URL and its
password can read and change every user's rows with psql. With it, each user connects as their
own role (named like their Unix account, which detslurm writes as each row's owner) and
PostgreSQL itself shows and lets them change only their own rows, whatever client they use:

- every table with an ``owner`` column: the rows whose owner is ``current_user``;
- every other table: the rows whose parent row (through its foreign key, down from
  ``experiments``) the user may see, so a trial, run, metric or checkpoint goes with its
  experiment;
- ``alembic_version``: read only; no user may create or alter tables (the admin migrates).

The policies are derived from the models' tables, so a table the schema gains is covered when
the admin runs this again, or refused by name when it has no path to an owner.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Table, text
from sqlalchemy.engine import Connection

from detslurm.errors import ConfigError, StateError

GROUP = "detslurm_users"  # every user's role is a member: the policies and grants name it
POLICY = "detslurm_owner"
_VERSION_TABLE = "alembic_version"
# Unix login names as useradd accepts them by default (and no longer than a PostgreSQL name).
_ROLE = re.compile(r"[a-z_][a-z0-9_.-]{0,62}")


def _q(name: str) -> str:
    """A quoted SQL identifier (role and table names may hold '-' or '.')."""
    return '"' + name.replace('"', '""') + '"'


def predicates(tables: Sequence[Table]) -> dict[str, str]:
    """Each table's row filter, parents first; StateError for a table with no path to an owner."""
    out: dict[str, str] = {}
    for table in tables:
        if "owner" in table.c:
            out[table.name] = f"{_q(table.name)}.owner = current_user"
            continue
        parent = next((fk for fk in sorted(table.foreign_keys, key=str) if fk.column.table.name in out), None)
        if parent is None:
            raise StateError(f"table {table.name} has no owner column and no parent with one: no policy can cover it")
        p = parent.column.table.name
        # The parent's own policy applies inside this subquery: visibility goes down the chain.
        out[table.name] = (
            f"EXISTS (SELECT 1 FROM {_q(p)} WHERE {_q(p)}.{_q(parent.column.name)} = "
            f"{_q(table.name)}.{_q(parent.parent.name)})"
        )
    return out


def check_roles(users: Sequence[str]) -> list[str]:
    bad = [u for u in users if not _ROLE.fullmatch(u) or u == GROUP]
    if bad:
        raise ConfigError([f"{u!r} is not a Unix login name detslurm can use as a role" for u in bad], source="roles")
    return list(dict.fromkeys(users))


@dataclass(frozen=True)
class Plan:
    """The statements that install the roles, grants and policies, in order."""

    statements: list[str]
    tables: list[str]


def plan(tables: Sequence[Table], users: Sequence[str], existing_roles: set[str], database: str) -> Plan:
    """Pure: the SQL for ``tables`` (parents first) and ``users``, given the roles that exist."""
    g = _q(GROUP)
    stmts = [] if GROUP in existing_roles else [f"CREATE ROLE {g} NOLOGIN"]
    for user in check_roles(users):
        if user not in existing_roles:
            # No password here: the admin sets one (ALTER ROLE ... PASSWORD) or uses peer,
            # GSSAPI or certificate authentication in pg_hba.conf.
            stmts.append(f"CREATE ROLE {_q(user)} LOGIN")
        stmts.append(f"GRANT {g} TO {_q(user)}")
    stmts += [
        f"GRANT CONNECT ON DATABASE {_q(database)} TO {g}",
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
        f"GRANT USAGE ON SCHEMA public TO {g}",
        f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {g}",
        f"GRANT SELECT ON {_q(_VERSION_TABLE)} TO {g}",
    ]
    for name, pred in predicates(tables).items():
        t = _q(name)
        stmts += [
            f"ALTER TABLE {t} ENABLE ROW LEVEL SECURITY",
            f"DROP POLICY IF EXISTS {POLICY} ON {t}",
            f"CREATE POLICY {POLICY} ON {t} TO {g} USING ({pred}) WITH CHECK ({pred})",
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON {t} TO {g}",
        ]
    return Plan(stmts, [t.name for t in tables])


def install(conn: Connection, users: Sequence[str]) -> Plan:
    """Run the plan on ``conn`` (the admin's, which owns the tables), in its transaction."""
    from detslurm.store.models import Base

    if conn.dialect.name != "postgresql":
        raise StateError("row-level security needs a PostgreSQL store (DETSLURM_DB_URL)")
    existing = set(conn.execute(text("SELECT rolname FROM pg_roles")).scalars())
    database = str(conn.execute(text("SELECT current_database()")).scalar())
    p = plan(Base.metadata.sorted_tables, users, existing, database)
    for stmt in p.statements:
        conn.execute(text(stmt))
    return p


def role_url(url: str, role: str) -> str:
    """The store's URL as ``role`` would give it (no password: theirs stays in ~/.pgpass)."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(username=role, password=None).render_as_string(hide_password=True)
