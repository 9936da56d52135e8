"""A probe job's report, read as untrusted input.

The report was written by code running on a compute node with whatever Python the site has; a
user (or anything else in the job) could have replaced it. So it is size-limited, every field is
type-checked, text is cut short and stripped of control characters, and anything wrong is a
:class:`ReportError` naming the field, never a traceback.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from detslurm.errors import DetSlurmError
from detslurm.util import printable

# A real report is a few KiB; anything much bigger was not written by our probe.
MAX_REPORT_BYTES = 256 * 1024
# Every text field ends up in one table cell.
_TEXT_LIMIT = 500


class ReportError(DetSlurmError):
    def __init__(self, where: str, problem: str) -> None:
        self.where = where
        self.problem = problem
        super().__init__(f"probe report {where}: {problem}")


@dataclass(frozen=True)
class DirCheck:
    name: str  # "experiments" or "checkpoints"
    path: str
    seen: bool  # the login node's test file was there, with its content
    written: bool  # the node could write its own test file
    error: str


@dataclass(frozen=True)
class DirFacts:
    path: str
    exists: bool
    # Owned by the job's user, writable by nobody else: what a per-job tmp dir looks like.
    private: bool
    writable: bool
    free_bytes: Optional[int]  # None where statvfs failed


@dataclass(frozen=True)
class Scratch:
    slurm_tmpdir: DirFacts
    tmpdir: DirFacts
    node_tmpdir: DirFacts
    chosen: Optional[DirFacts]  # None where detslurm is not importable on the node


@dataclass(frozen=True)
class Gpus:
    # What Slurm's gres plugin set for the job (None: not set at all, as on CPU nodes).
    cuda_visible_devices: Optional[str]
    slurm_job_gpus: Optional[str]
    nvidia_smi: tuple[str, ...]
    nvidia_smi_error: str


@dataclass(frozen=True)
class Container:
    runtime: str
    version: Optional[str]  # None: the runtime is missing or broken (``error`` says how)
    error: str
    image: str
    # None when no image was tried (none named, or no runtime to try it with).
    image_ok: Optional[bool]
    image_error: str


@dataclass(frozen=True)
class NodeReport:
    pool: str
    node: str
    job_id: str
    node_token: str
    dirs: tuple[DirCheck, ...]
    python_version: str
    python_executable: str
    detslurm_version: Optional[str]
    detslurm_error: str
    scratch: Scratch
    gpus: Gpus
    container: Container


class _Reader:
    """Typed access to one JSON object, naming the path of whatever is wrong."""

    # ``where`` is a JSON path ("report.dirs[0]"): errors name the exact field, as config errors do.
    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ReportError(where, "is not an object")
        self.data, self.where = data, where

    def _get(self, key: str, types: tuple[type, ...], optional: bool) -> Any:
        # A missing key reads as None, so "missing" and "null" are one error for required fields.
        value = self.data.get(key)
        if value is None and optional:
            return None
        # bool is an int in Python: a number field must not accept true/false, nor the reverse.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ReportError(f"{self.where}.{key}", f"expected {'/'.join(t.__name__ for t in types)}")
        return value

    def text(self, key: str) -> str:
        return clean(self._get(key, (str,), False))

    def opt_text(self, key: str) -> Optional[str]:
        value = self._get(key, (str,), True)
        return None if value is None else clean(value)

    def flag(self, key: str) -> bool:
        return bool(self._get(key, (bool,), False))

    def opt_flag(self, key: str) -> Optional[bool]:
        value = self._get(key, (bool,), True)
        return None if value is None else bool(value)

    def opt_int(self, key: str) -> Optional[int]:
        value = self._get(key, (int,), True)
        return None if value is None else int(value)

    def obj(self, key: str) -> _Reader:
        return _Reader(self.data.get(key), f"{self.where}.{key}")

    def opt_obj(self, key: str) -> Optional[_Reader]:
        return None if self.data.get(key) is None else self.obj(key)

    def items(self, key: str, limit: int) -> list[Any]:
        value = self._get(key, (list,), False)
        if len(value) > limit:
            raise ReportError(f"{self.where}.{key}", f"more than {limit} entries")
        return list(value)


def clean(text: str) -> str:
    """One short printable line: what a node wrote must not reshape the doctor's table."""
    return printable(text.replace("\n", " | ")).strip()[:_TEXT_LIMIT]


def _dir_facts(r: _Reader) -> DirFacts:
    return DirFacts(r.text("path"), r.flag("exists"), r.flag("private"), r.flag("writable"), r.opt_int("free_bytes"))


def _scratch(r: _Reader) -> Scratch:
    chosen = r.opt_obj("chosen")
    return Scratch(
        _dir_facts(r.obj("slurm_tmpdir")),
        _dir_facts(r.obj("tmpdir")),
        _dir_facts(r.obj("node_tmpdir")),
        _dir_facts(chosen) if chosen else None,
    )


def _gpus(r: _Reader) -> Gpus:
    # 64: more GPUs than any node has; a longer list is not nvidia-smi's output.
    lines = r.items("nvidia_smi", 64)
    if not all(isinstance(x, str) for x in lines):
        raise ReportError(f"{r.where}.nvidia_smi", "expected a list of strings")
    return Gpus(
        r.opt_text("cuda_visible_devices"),
        r.opt_text("slurm_job_gpus"),
        tuple(map(clean, lines)),
        r.text("nvidia_smi_error"),
    )


def _container(r: _Reader) -> Container:
    return Container(
        r.text("runtime"),
        r.opt_text("version"),
        r.text("error"),
        r.text("image"),
        r.opt_flag("image_ok"),
        r.text("image_error"),
    )


def _dir_check(r: _Reader) -> DirCheck:
    return DirCheck(r.text("name"), r.text("path"), r.flag("seen"), r.flag("written"), r.text("error"))


def parse_report(text: str) -> NodeReport:
    """The typed report, or ReportError saying what is wrong and where."""
    if len(text.encode(errors="replace")) > MAX_REPORT_BYTES:
        raise ReportError("", f"larger than {MAX_REPORT_BYTES} bytes")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ReportError("", f"not JSON ({e})") from None
    r = _Reader(data, "report")
    # The node may run an older or newer detslurm's probe: only a known layout is read.
    if r.data.get("version") != 1:
        raise ReportError("report.version", f"unknown version {r.data.get('version')!r}")
    py, det = r.obj("python"), r.obj("detslurm")
    return NodeReport(
        pool=r.text("pool"),
        node=r.text("node"),
        job_id=r.text("job_id"),
        node_token=r.text("node_token"),
        dirs=tuple(_dir_check(_Reader(d, f"report.dirs[{i}]")) for i, d in enumerate(r.items("dirs", 8))),
        python_version=py.text("version"),
        python_executable=py.text("executable"),
        detslurm_version=det.opt_text("version"),
        detslurm_error=det.text("error"),
        scratch=_scratch(r.obj("scratch")),
        gpus=_gpus(r.obj("gpus")),
        container=_container(r.obj("container")),
    )
