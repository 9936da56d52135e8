"""Row-level security on a shared PostgreSQL store (docs/admin/postgres.md), on a real server
(tests/pg_harness.py): after `det site postgres-rls`, each user's own role reads and changes only
their own rows, whatever SQL it sends, and a role outside detslurm's group reads nothing.

The two users are root (in-process det, role "root") and the second Unix user (a real det,
role "detslurm-mallory"). The raw SQL runs in this process under each role, as that user could
with psql and their own credentials (the test server's trust authentication lets it act as any
role; a real site gives each role a password or peer/GSSAPI authentication)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, ROOT
from security_harness import Attacker, run_as, shared_det, victim_base
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError
from test_views_ops import add_experiment, add_trial

from detslurm.store import open_store
from detslurm.store.models import Base
from detslurm.store.rls import predicates

pytestmark = pytest.mark.security
CORE = EXAMPLES / "core_api"


@pytest.fixture(scope="module")
def admin_url() -> Iterator[str]:
    from pg_harness import PostgresUnavailable, private_postgres

    try:
        with private_postgres("rls") as url:
            yield url
    except PostgresUnavailable as e:
        pytest.fail(str(e))


def as_role(url: str, role: str) -> str:
    return make_url(url).set(username=role).render_as_string(hide_password=False)


@pytest.fixture
def engines(admin_url: str) -> Iterator[dict[str, Engine]]:
    made: dict[str, Engine] = {}
    yield made
    for engine in made.values():
        engine.dispose()


def engine(engines: dict[str, Engine], url: str) -> Engine:
    if url not in engines:
        engines[url] = create_engine(url, isolation_level="AUTOCOMMIT")
    return engines[url]


def test_every_table_has_a_policy_down_from_an_owner() -> None:
    preds = predicates(Base.metadata.sorted_tables)
    assert set(preds) == set(Base.metadata.tables)
    assert preds["experiments"] == '"experiments".owner = current_user'
    assert preds["trials"].startswith('EXISTS (SELECT 1 FROM "experiments"')


def test_each_role_reads_and_changes_only_its_own_rows(
    det: Any,
    admin_url: str,
    engines: dict[str, Engine],
    monkeypatch: pytest.MonkeyPatch,
    mallory: Attacker,
    tmp_path: Path,
) -> None:
    mallory_name = mallory.user.pw_name
    base = victim_base()
    audit = base / "admin-site.yaml"
    audit.write_text(f"audit_log: {base / 'log/audit.log'}\n")
    audit.chmod(0o644)
    monkeypatch.setenv("DETSLURM_ADMIN_SITE_CONFIG", str(audit))
    try:
        # The admin: the dry run changes nothing; the real run installs roles and policies.
        monkeypatch.setenv("DETSLURM_DB_URL", admin_url)
        code, out, err = det("site", "postgres-rls", "--dry-run", "root", mallory_name)
        assert code == 0 and 'CREATE POLICY detslurm_owner ON "experiments"' in out, err
        admin = engine(engines, admin_url)
        with admin.connect() as c:
            roles = {r for (r,) in c.execute(text("SELECT rolname FROM pg_roles")) if r in ("root", mallory_name)}
        assert roles == set()
        code, out, err = det("site", "postgres-rls", "root", mallory_name)
        assert code == 0 and f"roles: root, {mallory_name}" in out, err
        assert f"DETSLURM_DB_URL={as_role(admin_url, 'USER')}" in out

        # Each user creates an experiment through det, as their own role.
        root_url, mallory_url = as_role(admin_url, "root"), as_role(admin_url, mallory_name)
        monkeypatch.setenv("DETSLURM_DB_URL", root_url)
        code, out, err = det("e", "create", "--local", "--paused", CORE / "const.yaml", CORE)
        assert code == 0, out + err
        store = open_store(root_url)
        root_exp = add_experiment(store, tmp_path / "e", owner="root")
        add_trial(store, root_exp, tmp_path / "a/b/c/run", "RUNNING")
        store.dispose()
        det_bin = shared_det(ROOT)
        home = mallory.home
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(home),
            "DETSLURM_DB_URL": mallory_url,
            "DETSLURM_DATA_DIR": str(home / "data"),
            "DETSLURM_EXPERIMENTS_DIR": str(home / "exps"),
            "DETSLURM_CONFIG": str(home / "no-config.yaml"),
        }

        def as_mallory(*args: str) -> Any:
            return run_as(mallory.user, [str(det_bin), *map(str, args)], env=env, cwd=str(home), timeout=600)

        r = as_mallory("e", "create", "--local", "--paused", CORE / "const.yaml", CORE)
        assert r.returncode == 0, r.stdout + r.stderr
        r = as_mallory("e", "list", "--json")
        assert r.returncode == 0 and [e["owner"] for e in json.loads(r.stdout)] == [mallory_name], r.stderr

        # Her role, with any SQL: only her rows, and no way to write rows of root's.
        m = engine(engines, mallory_url)
        with m.connect() as c:
            assert {o for (o,) in c.execute(text("SELECT owner FROM experiments"))} == {mallory_name}
            theirs = f"SELECT count(*) FROM trials WHERE experiment_id = {root_exp}"
            assert c.execute(text(theirs)).scalar() == 0
            assert c.execute(text("SELECT count(*) FROM trial_runs")).scalar() == 0
            assert c.execute(text(f"UPDATE experiments SET name = 'x' WHERE id = {root_exp}")).rowcount == 0
            assert c.execute(text(f"DELETE FROM experiments WHERE id = {root_exp}")).rowcount == 0
            assert c.execute(text(f"DELETE FROM trials WHERE experiment_id = {root_exp}")).rowcount == 0
            for forged in (
                "UPDATE experiments SET owner = 'root'",
                "INSERT INTO poll_stamps (owner, last_poll) VALUES ('root', now())",
                f"INSERT INTO trials (experiment_id, request_id, hparams, seed, restarts, run_count, "
                f"steps_completed, progress, early_stopped, searcher_ops, ops_completed, ops_closed, ops_idle) "
                f"VALUES ({root_exp}, 'r', '{{}}', 1, 0, 0, 0, 0, false, '[]', 0, false, false)",
            ):
                with pytest.raises(DBAPIError, match="row-level security"):
                    c.execute(text(forged))
            with pytest.raises(DBAPIError, match="permission denied"):
                c.execute(text("CREATE TABLE mine (x int)"))
        # Root's role sees only root's; the admin (the tables' owner) sees both.
        with engine(engines, root_url).connect() as c:
            assert {o for (o,) in c.execute(text("SELECT owner FROM experiments"))} == {"root"}
        with admin.connect() as c:
            assert {o for (o,) in c.execute(text("SELECT owner FROM experiments"))} == {"root", mallory_name}
            c.execute(text('CREATE ROLE "stranger" LOGIN'))
        # A role outside detslurm's group gets nothing at all.
        with engine(engines, as_role(admin_url, "stranger")).connect() as c:
            with pytest.raises(DBAPIError, match="permission denied"):
                c.execute(text("SELECT count(*) FROM experiments"))
        # Installing again (after an upgrade) keeps everything as it was.
        monkeypatch.setenv("DETSLURM_DB_URL", admin_url)
        code, out, err = det("site", "postgres-rls", "root", mallory_name)
        assert code == 0, err
        with m.connect() as c:
            assert {o for (o,) in c.execute(text("SELECT owner FROM experiments"))} == {mallory_name}
    finally:
        shutil.rmtree(base, ignore_errors=True)
