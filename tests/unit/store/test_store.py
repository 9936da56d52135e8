from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import func, inspect, select
from sqlalchemy.exc import IntegrityError

from detslurm.store import Experiment, IngestOffset, LogEntry, Metric, MetricPoint, Trial, TrialRun, open_store
from detslurm.store.models import Base
from detslurm.store.revisions import head_revision


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A real PostgreSQL server on loopback, private to this module (installed if missing)."""
    import glob
    import shutil
    import subprocess
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("starting a private PostgreSQL needs root (to run it as the postgres user)")
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        subprocess.run(
            ["apt-get", "-o", "DPkg::Lock::Timeout=900", "install", "-y", "-qq", "postgresql"],
            check=True,
            env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"),
            capture_output=True,
        )
    bindir = Path(sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1])
    # Not under pytest's basetemp: every pytest session (other test runs on this machine too)
    # makes /tmp/pytest-of-<user> private again, and the server user could then no longer reach
    # its data dir (the server outlived the tests: pg_ctl stop failed with "Permission denied").
    data = Path(tempfile.mkdtemp(prefix="detslurm-test-pg-"))
    shutil.chown(data, "postgres", "postgres")
    pg = ["runuser", "-u", "postgres", "--"]
    subprocess.run(
        [*pg, str(bindir / "initdb"), "-D", str(data / "db"), "-A", "trust", "-U", "postgres"],
        check=True,
        capture_output=True,
    )
    port = os.environ.get("DETSLURM_TEST_PG_PORT", "17432")
    subprocess.run(
        [
            *pg,
            str(bindir / "pg_ctl"),
            "-D",
            str(data / "db"),
            "-l",
            str(data / "log"),
            "-w",
            "-o",
            f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={data}",
            "start",
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run([*pg, str(bindir / "createdb"), "-h", "127.0.0.1", "-p", port, "detslurm"], check=True)
    yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/detslurm"
    subprocess.run([*pg, str(bindir / "pg_ctl"), "-D", str(data / "db"), "-m", "fast", "stop"], capture_output=True)
    shutil.rmtree(data, ignore_errors=True)


def _four_writers_lose_nothing(url: str, each: int) -> None:
    """Four processes each do ``each`` read-modify-write transactions on one trial."""
    exp_id = _make_experiment(url)
    store = open_store(url)
    with store.tx() as s:
        trial_id = s.scalars(select(Trial.id).where(Trial.experiment_id == exp_id)).one()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(url, trial_id, each, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with store.tx() as s:
        assert s.get(Trial, trial_id).restarts == 4 * each  # type: ignore[union-attr]
        count = select(func.count()).select_from(LogEntry).where(LogEntry.trial_id == trial_id)
        assert s.scalar(count) == 4 * each


def test_postgres_store_migrates_and_loses_nothing(postgres: str) -> None:
    store = open_store(postgres)
    with store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    _four_writers_lose_nothing(postgres, 20)


def _replay_migrations(url: str) -> None:
    """Every migration from an empty database up to head, as an existing store is upgraded."""
    from alembic import command
    from sqlalchemy import create_engine

    from detslurm.store import db

    engine = create_engine(url)
    with engine.begin() as conn:
        cfg = db._alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    engine.dispose()


def _sqlite_schema(path: Path) -> dict[str, tuple[object, ...]]:
    """Each table's columns (type, NOT NULL, default, primary key), indexes (unique or not, their
    columns; unique constraints are indexes too) and foreign keys (with ON DELETE), by name."""
    import sqlite3

    conn = sqlite3.connect(path)
    out: dict[str, tuple[object, ...]] = {}
    for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
        cols = sorted(r[1:] for r in conn.execute(f"PRAGMA table_info('{table}')"))
        indexes = sorted(
            (name, unique, tuple(c[2] for c in conn.execute(f"PRAGMA index_info('{name}')")))
            for _, name, unique, *_ in conn.execute(f"PRAGMA index_list('{table}')")
        )
        fks = sorted(r[2:] for r in conn.execute(f"PRAGMA foreign_key_list('{table}')"))
        out[table] = (cols, indexes, fks)
    conn.close()
    return out


def test_migrations_match_models(tmp_path: Path) -> None:
    replayed = tmp_path / "replayed.sqlite"
    _replay_migrations(f"sqlite:///{replayed}")
    store = open_store(f"sqlite:///{replayed}")  # already at head: nothing to do
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"models changed without a migration: {diff}"
    names = set(inspect(store.engine).get_table_names())
    assert {"experiments", "trials", "trial_runs", "metrics", "checkpoints", "ingest_offsets"} <= names
    open_store(store.url)  # a second open is a no-op


def test_a_new_store_is_created_with_the_schema_the_migrations_build(tmp_path: Path) -> None:
    """A brand-new SQLite store is made from the models and stamped at head (no migration is
    replayed): table for table the same schema as every migration replayed, and alembic reads the
    stamp as its own, so the next migration upgrades it like any other store."""
    from alembic.script import ScriptDirectory

    from detslurm.store import db

    replayed, created = tmp_path / "replayed.sqlite", tmp_path / "created.sqlite"
    _replay_migrations(f"sqlite:///{replayed}")
    store = open_store(f"sqlite:///{created}")
    assert _sqlite_schema(created) == _sqlite_schema(replayed)
    assert set(_sqlite_schema(created)) >= {"experiments", "trials", "trial_runs", "metrics", "alembic_version"}
    head = ScriptDirectory.from_config(db._alembic_config()).get_current_head()
    with store.engine.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() == head
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    assert created.stat().st_mode & 0o077 == 0  # private to the user, as a migrated one
    # A store with any table is never created over: it takes the migrations' path.
    assert store._create_new() is False
    _make_experiment(store.url)  # and it works as a store


def _make_experiment(url: str) -> int:
    store = open_store(url)
    with store.tx() as s:
        e = Experiment(
            name="x",
            owner="u",
            config={},
            original_config="",
            context_sha256="0",
            exp_dir="/tmp",
            executor="local",
            resource_pool="",
            progress=0.0,
            archived=False,
            test_mode=False,
            state="ACTIVE",
        )
        s.add(e)
        s.flush()
        s.add(
            Trial(
                experiment_id=e.id,
                request_id="r",
                hparams={},
                seed=1,
                restarts=0,
                run_count=0,
                steps_completed=0,
                progress=0.0,
                early_stopped=False,
                searcher_ops=[],
                ops_completed=0,
                ops_closed=False,
                ops_idle=False,
            )
        )
        return int(e.id)


def _writer(url: str, trial_id: int, n: int, who: int) -> None:
    store = open_store(url)
    for i in range(n):
        with store.tx() as s:
            # read-modify-write: lost updates would show up as a wrong counter
            t = s.get(Trial, trial_id)
            assert t is not None
            t.restarts = t.restarts + 1
            s.add(LogEntry(trial_id=trial_id, message=f"{who}-{i}"))


def test_parallel_processes_lose_nothing(tmp_path: Path) -> None:
    _four_writers_lose_nothing(f"sqlite:///{tmp_path / 'db.sqlite'}", 40)
    assert (tmp_path / "db.sqlite").stat().st_mode & 0o077 == 0  # private to the user


def test_failed_transaction_rolls_back(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    exp_id = _make_experiment(store.url)
    try:
        with store.tx() as s:
            e = s.get(Experiment, exp_id)
            assert e is not None
            e.state = "PAUSED"
            raise OSError("crash mid-operation")
    except OSError:
        pass
    with store.tx() as s:
        assert s.get(Experiment, exp_id).state == "ACTIVE"  # type: ignore[union-attr]


def test_head_revision_is_alembics_head() -> None:
    from alembic.script import ScriptDirectory

    from detslurm.store import db

    assert ScriptDirectory.from_config(db._alembic_config()).get_current_head() == head_revision()


def _odd_values_round_trip(url: str) -> None:
    """Values PostgreSQL rejects unless sanitised: NaN/inf in JSON, NUL in strings, a
    200-character metric group and a 300-character job id."""
    from datetime import datetime, timezone

    from detslurm.store import Metric, TrialRun
    from detslurm.store.sanitize import clean_text, json_safe, metric_group

    exp_id = _make_experiment(url)
    store = open_store(url)
    group, job_id = "g" * 199 + "\x00h", "local:" + "/very/long/path" * 20
    with store.tx() as s:
        trial_id = s.scalars(select(Trial.id).where(Trial.experiment_id == exp_id)).one()
        s.add(TrialRun(trial_id=trial_id, run_id=1, executor="local", job_id=job_id, run_dir="/r", log_path="/l"))
        s.add(
            Metric(
                trial_id=trial_id,
                run_id=1,
                group=metric_group(group),
                steps_completed=1,
                metrics=json_safe({"loss": float("nan"), "acc": float("inf"), "n\x00ame": "a\x00b"}),
                batch_metrics=json_safe([{"x": float("-inf")}]),
                report_time=datetime.now(timezone.utc),
            )
        )
        s.add(LogEntry(trial_id=trial_id, message=clean_text("bad\x00line")))
    with store.read() as s:
        m = s.scalars(select(Metric).where(Metric.trial_id == trial_id)).one()
        assert (len(m.group), m.metrics, m.batch_metrics) == (
            200,
            {"loss": "NaN", "acc": "Infinity", "name": "ab"},
            [{"x": "-Infinity"}],
        )
        run = s.scalars(select(TrialRun).where(TrialRun.trial_id == trial_id)).one()
        assert run.job_id == job_id and len(job_id) > 300
        assert s.scalars(select(LogEntry.message).where(LogEntry.trial_id == trial_id)).one() == "badline"


def test_odd_values_round_trip_sqlite(tmp_path: Path) -> None:
    _odd_values_round_trip(f"sqlite:///{tmp_path / 'db.sqlite'}")


def test_odd_values_round_trip_postgres(postgres: str) -> None:
    _odd_values_round_trip(postgres)


def test_postgres_reader_is_not_blocked_by_a_writer(postgres: str) -> None:
    import time

    store = open_store(postgres)
    exp_id = _make_experiment(postgres)
    with store.tx() as w:
        w.get(Experiment, exp_id).state = "PAUSED"  # type: ignore[union-attr]
        w.flush()  # holds the owner's advisory lock and the row lock until the block ends
        start = time.monotonic()
        with store.read() as r:
            assert r.get(Experiment, exp_id).state == "ACTIVE"  # type: ignore[union-attr]
        assert time.monotonic() - start < 20  # not the lock wait


def test_postgres_lock_waits_are_bounded_and_per_owner(postgres: str) -> None:
    import time

    from sqlalchemy import create_engine, text

    from detslurm.errors import StoreError
    from detslurm.store import db

    store = open_store(postgres, lock_timeout_s=1)
    _make_experiment(postgres)
    other = create_engine(postgres)
    own = (db._PG_LOCK_CLASS, os.getuid() % 2**31)
    with other.connect() as conn:
        # Another user's lock and the migration lock do not hold this user's writes up...
        conn.execute(text("SELECT pg_advisory_lock(:a, :b)"), {"a": own[0], "b": own[1] + 1})
        conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": db._PG_LOCK_KEY})
        with store.tx() as s:
            assert s.scalars(select(func.count(Experiment.id))).one() >= 1
        # ...this user's lock, held by a stuck client, makes the wait end in a clear error.
        conn.execute(text("SELECT pg_advisory_lock(:a, :b)"), {"a": own[0], "b": own[1]})
        start = time.monotonic()
        with pytest.raises(StoreError, match=r"is busy: .* more than 1 s") as e, store.tx() as s:
            s.scalars(select(Experiment.id)).all()
        assert time.monotonic() - start < 30
        assert "postgres@127.0.0.1" in str(e.value)
        conn.execute(text("SELECT pg_advisory_unlock_all()"))
        conn.commit()
    with store.tx() as s:  # the pool's connection is usable again after the timeout
        assert s.scalars(select(func.count(Experiment.id))).one() >= 1
    other.dispose()


def _upgrade_keeps_rows(url: str) -> None:
    """A store made by revision 0001, with rows in every table a migration rebuilds, upgrades to
    head without losing any (SQLite rebuilds altered tables: a DROP TABLE with foreign keys on
    would cascade into ingest_offsets and re-ingest every event)."""
    from alembic import command
    from sqlalchemy import create_engine, text

    from detslurm.store import db

    engine = create_engine(url)
    with engine.begin() as conn:
        cfg = db._alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
    exp_id = None
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO experiments (id, name, owner, state, config, original_config, context_sha256, exp_dir,"
                " executor, resource_pool, progress, archived, test_mode, start_time)"
                " VALUES (1, 'x', 'u', 'ACTIVE', '{}', '', '0', '/e', 'local', '', 0, false, false, CURRENT_TIMESTAMP)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO trials (id, experiment_id, request_id, state, hparams, seed, restarts, run_count,"
                " steps_completed, progress, early_stopped, searcher_ops, ops_completed, ops_closed, ops_idle,"
                " start_time) VALUES (1, 1, 'r', 'ACTIVE', '{}', 1, 0, 0, 0, 0, false, '[]', 0, false, false,"
                " CURRENT_TIMESTAMP)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO trial_runs (id, trial_id, run_id, state, executor, job_id, run_dir, log_path,"
                " preempt_acked, restart_count_seen, submit_time) VALUES (1, 1, 1, 'RUNNING', 'local', 'j1', '/r',"
                " '/l', false, 0, CURRENT_TIMESTAMP)"
            )
        )
        conn.execute(text("INSERT INTO ingest_offsets (trial_run_pk, file, \"offset\") VALUES (1, 'rank-0.jsonl', 77)"))
        conn.execute(
            text(
                'INSERT INTO metrics (trial_id, run_id, "group", steps_completed, metrics, report_time, archived)'
                ' VALUES (1, 1, \'training\', 5, \'{"loss": 1.5, "note": "x", "ok": true}\', CURRENT_TIMESTAMP, false)'
            )
        )
        exp_id = 1
    engine.dispose()
    store = open_store(url)
    with store.read() as s:
        assert s.scalars(select(func.count()).select_from(IngestOffset)).one() == 1
        assert s.scalars(select(TrialRun.job_id)).one() == "j1"
        assert s.scalars(select(Metric.group)).one() == "training"
        assert s.get(Experiment, exp_id) is not None
        # 0003 unpacked the old report's numbers (only them) into the dashboard's points.
        p = MetricPoint
        assert s.execute(select(p.trial_id, p.group, p.name, p.steps_completed, p.value)).all() == [
            (1, "training", "loss", 5, 1.5)
        ]
    with store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    with store.tx() as s:  # foreign keys are enforced again after the migration
        s.add(LogEntry(trial_id=999, message="orphan"))
        with pytest.raises(IntegrityError):
            s.flush()
        s.rollback()


def test_upgrade_from_0001_keeps_rows_sqlite(tmp_path: Path) -> None:
    _upgrade_keeps_rows(f"sqlite:///{tmp_path / 'old.sqlite'}")


def test_upgrade_from_0001_keeps_rows_postgres(postgres: str) -> None:
    from sqlalchemy import create_engine, text

    admin = create_engine(postgres, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("CREATE DATABASE upgrade_test"))
    admin.dispose()
    _upgrade_keeps_rows(postgres.rsplit("/", 1)[0] + "/upgrade_test")


def _bulk_metrics_store_the_same(url: str) -> None:
    """Ingest's bulk insert (bulk_metrics: sqlite3's own executemany on SQLite, SQLAlchemy Core
    on PostgreSQL) stores the same rows and points on both, and a row the store refuses costs
    only itself on both."""
    from datetime import datetime, timezone

    from detslurm.controller.bulk_metrics import PendingMetrics
    from detslurm.protocol import Line, Metrics

    exp_id = _make_experiment(url)
    store = open_store(url)
    odd = {"loss": 0.5, "big": 10**40, "nan": float("nan"), "flag": True, "nested": {"a": [1, float("inf")]}}
    when = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=timezone.utc)
    first, second = Line(0, 10, b"first"), Line(10, 20, b"second")
    refused: list[tuple[Line, str]] = []
    with store.tx() as s:
        trial_id = s.scalars(select(Trial.id).where(Trial.experiment_id == exp_id)).one()
        pending = PendingMetrics(trial_id, 1)
        pending.add(first, Metrics(group="training", steps_completed=1, metrics=odd, time=1.0), when)
        pending.add(
            second, Metrics(group="v", steps_completed=2, metrics={"acc": 1}, batch_metrics=[{}], time=1.0), when
        )
        assert pending.flush(s, lambda line, why: refused.append((line, why))) == 0
        orphan = PendingMetrics(trial_id + 1000, 1)  # no such trial: the foreign key refuses its row
        orphan.add(first, Metrics(group="training", steps_completed=3, metrics={"loss": 1.0}, time=1.0), when)
        assert orphan.flush(s, lambda line, why: refused.append((line, why))) == 1
    assert [line for line, _ in refused] == [first] and "IntegrityError" in refused[0][1]
    with store.read() as s:
        # This trial's only: the PostgreSQL server is shared by the module's tests.
        mine = select(Metric.group, Metric.metrics, Metric.batch_metrics, Metric.report_time)
        rows = list(s.execute(mine.where(Metric.trial_id == trial_id).order_by(Metric.id)))
        points = sorted(
            s.execute(
                select(MetricPoint.steps_completed, MetricPoint.name, MetricPoint.value).where(
                    MetricPoint.trial_id == trial_id
                )
            )
        )
    store.dispose()
    assert [(g, m, b) for g, m, b, _ in rows] == [
        ("training", {"loss": 0.5, "big": 10**40, "nan": "NaN", "flag": True, "nested": {"a": [1, "Infinity"]}}, None),
        ("v", {"acc": 1}, [{}]),
    ]
    # SQLite reads its DATETIME back naive (UTC), PostgreSQL aware: the same instant either way.
    assert {t.replace(tzinfo=t.tzinfo or timezone.utc) for *_, t in rows} == {when}
    assert points == [(1, "big", 1e40), (1, "loss", 0.5), (2, "acc", 1.0)]


def test_bulk_metrics_sqlite(tmp_path: Path) -> None:
    _bulk_metrics_store_the_same(f"sqlite:///{tmp_path / 'db.sqlite'}")


def test_bulk_metrics_postgres(postgres: str) -> None:
    _bulk_metrics_store_the_same(postgres)


def _revisions() -> list[tuple[str, str]]:
    """(file name, revision id) of every migration, oldest first (the down_revision chain)."""
    from alembic.script import ScriptDirectory

    from detslurm.store import db

    scripts = ScriptDirectory.from_config(db._alembic_config())
    return [(Path(str(sc.path)).name, sc.revision) for sc in reversed(list(scripts.walk_revisions()))]


def test_migration_files_are_named_after_their_revisions() -> None:
    revs = _revisions()
    assert [r for _, r in revs][:2] == ["0001", "0002"] and len(revs) >= 6
    for name, rev in revs:
        assert name.startswith(f"{rev}_") or name == f"{rev}.py", (name, rev)


@pytest.mark.parametrize("old", ["0001", "0002", "0003_verbs", "0003_dashboard", "0004_cli15"])
def test_a_store_at_any_applied_revision_upgrades_to_head(tmp_path: Path, old: str) -> None:
    """The ids existing stores are stamped with: each one is still a revision alembic upgrades."""
    from alembic import command
    from sqlalchemy import create_engine

    from detslurm.store import db

    assert old in [r for _, r in _revisions()]
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    engine = create_engine(url)
    with engine.begin() as conn:
        cfg = db._alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, old)
    engine.dispose()
    exp_id = _make_experiment(url)  # open_store upgrades it first
    store = open_store(url)
    with store.engine.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() == head_revision()
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    with store.read() as s:
        assert s.get(Experiment, exp_id) is not None


def test_the_read_layer_answers_on_postgres(postgres: str) -> None:
    """store.reads through PostgreSQL's connection: JSON already decoded, aware times, booleans,
    the scope's "not found"; the same dicts views gives (built there by the same layer)."""
    from datetime import datetime, timezone

    from detslurm import views
    from detslurm.errors import NotFoundError
    from detslurm.identity import Scope
    from detslurm.store import Checkpoint
    from detslurm.store.reads import Reads

    exp_id = _make_experiment(postgres)
    store = open_store(postgres)
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    with store.tx() as s:
        e = s.get(Experiment, exp_id)
        assert e is not None
        e.config = {"labels": ["pg"], "searcher": {"metric": "loss"}}
        trial = s.scalars(select(Trial).where(Trial.experiment_id == exp_id)).one()
        trial.runner_state = "queued: Resources"
        tid = trial.id
        s.add(TrialRun(trial_id=tid, run_id=1, executor="local", run_dir="/r", log_path="/r/out", state="QUEUED"))
        s.add(
            Metric(
                trial_id=tid, run_id=1, group="validation", steps_completed=4, metrics={"loss": 0.25}, report_time=when
            )
        )
        s.add(
            Checkpoint(
                uuid=f"pg-{exp_id}",
                trial_id=tid,
                run_id=1,
                steps_completed=4,
                storage_path="/c",
                metadata_={"a": [1]},
                resources={"f": 1},
                size=3,
                report_time=when,
            )
        )
    reads = Reads.of_store(store)
    d, cfg = reads.experiment(exp_id, "u")
    assert d["labels"] == ["pg"] and cfg["searcher"]["metric"] == "loss" and d["archived"] is False
    (t,) = reads.trial_dicts(exp_id, "u")
    assert t["batches"] == 4 and t["hparams"] == {} and "(Resources)" in t["pending_reason"]
    (ck,) = reads.checkpoint_dicts(exp_id, "u")
    assert ck["validation_metric"] == 0.25 and ck["metadata"] == {"a": [1]} and ck["report_time"] == when
    assert [r["state"] for r in reads.run_dicts(tid)] == ["QUEUED"]
    assert reads.metrics(tid)[0]["metrics"] == {"loss": 0.25}
    assert reads.has_unfinished("local", "u") and exp_id in [
        r.id for r in reads.experiment_rows("u")
    ]  # the module's database has others
    with pytest.raises(NotFoundError):
        reads.experiment(exp_id, "someone-else")
    with store.read() as s:
        e = views.get_experiment(s, exp_id, Scope("u"))
        assert views.experiment_dict(e) == d and views.trial_dict(s, e.trials[0]) == t
    store.dispose()
