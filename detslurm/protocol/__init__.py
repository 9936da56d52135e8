"""The shared-filesystem protocol between the controller and its trials: the only module both
sides import.

* Login side (controller, slurm, store, cli, daemon, views, queue): builds paths with
  :class:`ExpPaths`/:class:`RunPaths`, the trial environment with :func:`trial_env`, writes the
  control/ops/best-validation records, and reads events with :func:`read_lines` + :func:`decode`
  and exit records with :func:`exit_outcome`; it never imports core, pytorch, exec or launch.
* In-job side (core, pytorch, exec, launch): reads the environment with :func:`from_env`,
  writes events with :func:`encode` and exit records with :class:`ExitRecord`, and reads the
  control/ops records; it imports only this package and leaf modules (util, errors, context).

Layout of an experiment dir: ``context.tar.gz``, ``config.yaml``, ``best_validation.json``,
``arrays/t<T>-r<R>/``, ``trials/<t>/{searcher_ops.json,metadata.json}`` and per run
``trials/<t>/runs/<r>/{events/rank-<N>.jsonl,control.json,exit.json,exit-node<N>.json,job_id,
output.log,signals,rendezvous-*.json,rank-failed-*}``. ``tests/unit/test_layering.py`` enforces the
import rules.
"""

# Trial-written files are untrusted input: every decoder here turns malformed content into
# BadRecord/BadEvent, which the controller reports instead of crashing on.
from detslurm.protocol._check import BadRecord

# Contract 1: trial_env (login side) and from_env (in the job) sit in one module, so the DET_*
# variables one side writes are exactly those the other reads.
from detslurm.protocol.env import ClusterInfo, TrialInfo, entrypoint_from_env, expand_nodelist, from_env, trial_env

# Contract 2: the append-only event lines (metrics, progress, checkpoints, exits); one encoder and
# one decoder, so a format change cannot reach only one side.
from detslurm.protocol.events import (
    Alert,
    BadEvent,
    CheckpointDeleted,
    CheckpointSaved,
    EarlyExit,
    Event,
    EventType,
    Metrics,
    OpCompleted,
    PreemptAck,
    Progress,
    RunMetadata,
    Status,
    UnknownEvent,
    decode,
    decode_value,
    encode,
)

# Both sides compute every path from here: a file named differently on one side would leave the
# controller waiting for something the trial wrote elsewhere.
from detslurm.protocol.paths import IN_CONTAINER_ENV, NODE_TMPDIR_ENV, ExpPaths, NotARunDir, RunPaths, exit_record_of

# Bounded, exactly-once reading of event files from a byte offset the store commits with the rows.
from detslurm.protocol.reader import Batch, Line, read_lines

# Whole-file JSON records, unlike the append-only events: control requests one way (contract 3),
# exit records the other, each read with a size bound.
from detslurm.protocol.records import (
    BATCH_EXIT_PRINTF,
    IMAGE_EXIT_PRINTF,
    IMAGE_SOURCE,
    BestValidation,
    ControlRecord,
    ExitOutcome,
    ExitRecord,
    SearcherOps,
    exit_outcome,
)

# What the rest of detslurm may import from the protocol; tests/unit/test_layering.py keeps the login
# side and the in-job side from importing each other around it.
__all__ = [
    "BATCH_EXIT_PRINTF",
    "IMAGE_EXIT_PRINTF",
    "IMAGE_SOURCE",
    "NODE_TMPDIR_ENV",
    "IN_CONTAINER_ENV",
    "Alert",
    "BadEvent",
    "BadRecord",
    "Batch",
    "BestValidation",
    "CheckpointDeleted",
    "CheckpointSaved",
    "ClusterInfo",
    "ControlRecord",
    "EarlyExit",
    "Event",
    "EventType",
    "ExitOutcome",
    "ExitRecord",
    "ExpPaths",
    "Line",
    "Metrics",
    "NotARunDir",
    "OpCompleted",
    "PreemptAck",
    "Progress",
    "RunMetadata",
    "RunPaths",
    "SearcherOps",
    "Status",
    "TrialInfo",
    "UnknownEvent",
    "decode",
    "decode_value",
    "encode",
    "entrypoint_from_env",
    "exit_outcome",
    "exit_record_of",
    "expand_nodelist",
    "from_env",
    "read_lines",
    "trial_env",
]
