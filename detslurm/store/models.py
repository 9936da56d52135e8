"""SQLAlchemy 2 models. The schema is owned by the Alembic migrations next to this file;
a change here needs a new revision there (tests compare the two)."""

from __future__ import annotations

import enum
from datetime import datetime, timezone
from typing import Any, TypeVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

# Defined without SQLAlchemy (the read layer, store.reads, needs them too); exported from here as before.
from detslurm.store.states import ExperimentState as ExperimentState
from detslurm.store.states import RunState as RunState
from detslurm.store.states import TrialState as TrialState


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


E = TypeVar("E", bound=enum.Enum)


class EnumColumn(TypeDecorator[E]):
    """An enum kept as its value in a plain VARCHAR: the schema (and the Alembic migrations)
    stay as they were, code reads and writes enum members, and a value this version does not
    know (a newer detslurm wrote it) fails loudly on read instead of passing as a string."""

    impl = String
    cache_ok = True

    def __init__(self, enum_cls: type[E], length: int) -> None:
        super().__init__(length)
        self.enum_cls = enum_cls

    def process_bind_param(self, value: E | str | None, dialect: Dialect) -> str | None:
        # Accepts the members and their values alike (queries may pass either).
        return None if value is None else str(self.enum_cls(value).value)

    def process_result_value(self, value: str | None, dialect: Dialect) -> E | None:
        return None if value is None else self.enum_cls(value)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Experiment(Base):
    __tablename__ = "experiments"
    # Every read command asks whether the caller has unfinished experiments (store.reads: Reads.has_unfinished).
    __table_args__ = (Index("ix_experiments_owner_executor_state", "owner", "executor", "state"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(512))
    owner: Mapped[str] = mapped_column(String(128))
    state: Mapped[ExperimentState] = mapped_column(EnumColumn(ExperimentState, 32), default=ExperimentState.ACTIVE)
    description: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Free text the user keeps with the experiment (the SDK's Experiment.set_notes).
    notes: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The validated config with defaults (expconf.ExperimentConfig.as_dict); read back through
    # expconf.from_stored, which validates it again. original_config is the YAML as the user wrote it.
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    original_config: Mapped[str] = mapped_column(Text)
    context_sha256: Mapped[str] = mapped_column(String(64))
    exp_dir: Mapped[str] = mapped_column(Text)
    executor: Mapped[str] = mapped_column(String(16), default="local")
    resource_pool: Mapped[str] = mapped_column(String(128), default="")
    # SearchMethod.state_dict(), written in the same transaction as the events that changed it.
    searcher_state: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    parent_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    archived: Mapped[bool] = mapped_column(Boolean, default=False)
    test_mode: Mapped[bool] = mapped_column(Boolean, default=False)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    start_time: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    end_time: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    trials: Mapped[list[Trial]] = relationship(
        back_populates="experiment", order_by="Trial.id", cascade="all, delete-orphan", passive_deletes=True
    )


class Trial(Base):
    __tablename__ = "trials"
    __table_args__ = (UniqueConstraint("experiment_id", "request_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    experiment_id: Mapped[int] = mapped_column(ForeignKey("experiments.id", ondelete="CASCADE"), index=True)
    # The searcher's id for the trial; unique per experiment, so a replayed Create action cannot
    # make a second row.
    request_id: Mapped[str] = mapped_column(String(64))
    state: Mapped[TrialState] = mapped_column(EnumColumn(TrialState, 32), default=TrialState.ACTIVE)
    hparams: Mapped[dict[str, Any]] = mapped_column(JSON)
    seed: Mapped[int] = mapped_column(BigInteger)
    # Failures charged against max_restarts; run_count numbers every run (preemptions included).
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    run_count: Mapped[int] = mapped_column(Integer, default=0)
    latest_checkpoint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    steps_completed: Mapped[int] = mapped_column(BigInteger, default=0)
    warm_start_checkpoint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    searcher_metric: Mapped[float | None] = mapped_column(Float, nullable=True)
    runner_state: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The searcher said "stop" (early stop / done); the next exit completes the trial.
    early_stopped: Mapped[bool] = mapped_column(Boolean, default=False)
    # 0.37-style searcher operations: absolute lengths handed to the trial so far.
    searcher_ops: Mapped[list[Any]] = mapped_column(JSON, default=list)
    ops_completed: Mapped[int] = mapped_column(Integer, default=0)
    ops_closed: Mapped[bool] = mapped_column(Boolean, default=False)
    ops_idle: Mapped[bool] = mapped_column(Boolean, default=False)
    exit_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    start_time: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    end_time: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    experiment: Mapped[Experiment] = relationship(back_populates="trials")
    # selectin: a tick walks every trial's runs; one query for all of them, not one per trial.
    runs: Mapped[list[TrialRun]] = relationship(
        back_populates="trial",
        order_by="TrialRun.run_id",
        cascade="all, delete-orphan",
        passive_deletes=True,
        lazy="selectin",
    )


class TrialRun(Base):
    __tablename__ = "trial_runs"
    __table_args__ = (UniqueConstraint("trial_id", "run_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[int] = mapped_column(Integer)
    state: Mapped[RunState] = mapped_column(EnumColumn(RunState, 16), default=RunState.PENDING)
    executor: Mapped[str] = mapped_column(String(16))
    # Text: a --local job id holds a path (migration 0002).
    job_id: Mapped[str | None] = mapped_column(Text, nullable=True)
    run_dir: Mapped[str] = mapped_column(Text)
    log_path: Mapped[str] = mapped_column(Text)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    exit_reason: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The trial acknowledged a stop request (PreemptAck event): its exit is then a clean pause or
    # stop, not a failure (controller/decide.py).
    preempt_acked: Mapped[bool] = mapped_column(Boolean, default=False)
    # When Slurm's signal reached the trial (its clock) and how long the trial took from there to
    # its acknowledged checkpoint: compared with the site's budget (detslurm/slurm/budget.py).
    preempt_signal_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    preempt_stop_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    restart_count_seen: Mapped[int] = mapped_column(Integer, default=0)
    submit_time: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    start_time: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    end_time: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    trial: Mapped[Trial] = relationship(back_populates="runs")


class Metric(Base):
    __tablename__ = "metrics"
    __table_args__ = (
        Index("ix_metrics_trial_group_steps", "trial_id", "group", "steps_completed"),
        # A trial's reports by step whatever their group (`det e describe`'s latest workloads,
        # the trial's batches): read from the index's end instead of sorting all of them.
        Index("ix_metrics_trial_steps", "trial_id", "steps_completed"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"))
    run_id: Mapped[int] = mapped_column(Integer)
    # Bounded by sanitize.METRIC_GROUP_MAX, which ingest enforces (migration 0002).
    group: Mapped[str] = mapped_column(String(256))
    steps_completed: Mapped[int] = mapped_column(BigInteger)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    batch_metrics: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    report_time: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # Rows past the checkpoint a restart resumed from are archived, not deleted: no step is
    # counted twice, and nothing reported is lost.
    archived: Mapped[bool] = mapped_column(Boolean, default=False)


class MetricPoint(Base):
    """One numeric value of a metric report, unpacked from :class:`Metric` at ingest: what the
    dashboard's curves read. A curve of a million points is then an index range over plain
    floats, where reading it from ``Metric.metrics`` would parse a million JSON documents."""

    __tablename__ = "metric_points"
    # Covering: a curve query reads the index alone, never the table rows (a third faster at 1M).
    __table_args__ = (
        Index(
            "ix_metric_points_curve", "trial_id", "group", "name", "archived", "steps_completed", "value", "report_time"
        ),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"))
    group: Mapped[str] = mapped_column(String(256))
    # Names longer than this are not kept as points (the report itself keeps them in Metric).
    name: Mapped[str] = mapped_column(String(256))
    steps_completed: Mapped[int] = mapped_column(BigInteger)
    report_time: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    value: Mapped[float] = mapped_column(Float)
    # Mirrors Metric.archived (a restart archives both).
    archived: Mapped[bool] = mapped_column(Boolean, default=False)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    uuid: Mapped[str] = mapped_column(String(64), primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[int] = mapped_column(Integer)
    steps_completed: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16), default="COMPLETED")
    storage_path: Mapped[str] = mapped_column(Text)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    resources: Mapped[dict[str, Any]] = mapped_column(JSON)
    size: Mapped[int] = mapped_column(BigInteger, default=0)
    report_time: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class IngestOffset(Base):
    """Byte offset of each events file, committed with the rows it produced (contract 2)."""

    __tablename__ = "ingest_offsets"
    trial_run_pk: Mapped[int] = mapped_column(ForeignKey("trial_runs.id", ondelete="CASCADE"), primary_key=True)
    file: Mapped[str] = mapped_column(String(256), primary_key=True)
    # Only complete lines are counted: a torn last line is re-read from here on the next tick.
    offset: Mapped[int] = mapped_column(BigInteger, default=0)


class LogEntry(Base):
    """Controller messages shown with the trial's logs (restarts, exits, searcher decisions)."""

    __tablename__ = "trial_log_entries"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"), index=True)
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    level: Mapped[str] = mapped_column(String(16), default="INFO")
    message: Mapped[str] = mapped_column(Text)


class PollStamp(Base):
    """When a read command without a daemon last polled Slurm for this user: the next read
    within the site's poll_interval_s reuses that poll instead of making another."""

    __tablename__ = "poll_stamps"
    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    last_poll: Mapped[datetime] = mapped_column(DateTime(timezone=True))
