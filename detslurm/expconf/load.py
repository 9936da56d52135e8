"""Parse, override and validate an experiment config; errors come one per line with a path.

Error lines follow Determined's shape, ``<config>.searcher.metric: ...``, sorted, so the user
sees every problem at once instead of fixing them one submit at a time.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from detslurm import ckpt_settings
from detslurm.errors import CONFIG_ROOT, ConfigError
from detslurm.expconf import schema as s
from detslurm.expconf.hparams import check_hyperparameters, normalize_hyperparameters
from detslurm.expconf.sbatch_args import check_sbatch_args

# Determined prints config paths from this literal root ("<config>.searcher.metric: ..."), and
# from_stored() swaps it for "stored config" so a bad database row is told apart from a bad file;
# where the file is known, ConfigError.in_file() names it instead (load_config, `det e create`).
ROOT = CONFIG_ROOT


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` as a float (YAML 1.1 wants ``1.0e-3``); users write
    learning rates that way and would otherwise get a confusing "not a number" error."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, where: str = ROOT) -> dict[str, Any]:
    """Parse one YAML document into a mapping, or raise ConfigError naming the line and column."""
    if not text.strip():
        raise ConfigError([f"{where}: the file is empty; an experiment config is a YAML mapping"])
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        pos = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"{where}: invalid YAML{pos}: {problem}"]) from None
    # A file holding only comments parses to None, not to {}; report it as empty rather than
    # as "got NoneType".
    if data is None:
        raise ConfigError([f"{where}: the file is empty; an experiment config is a YAML mapping"])
    if not isinstance(data, dict):
        raise ConfigError([f"{where}: must be a mapping of keys to values, got {_kind(data)}"])
    return data


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def apply_overrides(config: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``--config key.sub=value`` overrides (value parsed as YAML; ``a,b`` is a list)."""
    # Deep copy through JSON: the caller's dict stays untouched, and the result is plain JSON types.
    out = json.loads(json.dumps(config))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError([f"--config {item!r}: expected key.sub=value"])
        try:
            # ``tags=a,b`` is a list; an explicit YAML flow value (``[a, b]`` or ``{k: v}``) keeps its own
            # commas, so a flow mapping can still be passed.
            if "," in text and not text.strip().startswith(("[", "{")):
                value: Any = [yaml.load(v, Loader=_Loader) for v in text.split(",")]
            else:
                value = yaml.load(text, Loader=_Loader) if text else ""
        except yaml.YAMLError:
            raise ConfigError([f"--config {item!r}: value is not valid YAML"]) from None
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.get(p)
            # Missing or scalar intermediate keys are replaced by a mapping: an override may create a section
            # the file did not have (``--config slurm.gpu_type=a100``).
            if not isinstance(nxt, dict):
                nxt = {}
                node[p] = nxt
            node = nxt
        node[parts[-1]] = value
    return out  # type: ignore[no-any-return]  # json round trip of a dict


def _loc(prefix: str, loc: Sequence[int | str]) -> str:
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _valid_keys(model: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """The field names of the model found at ``loc`` (for "unknown key" messages)."""
    cls: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        fld = cls.model_fields.get(part)
        if fld is None:
            return []
        cls = _inner_model(fld.annotation)
        if cls is None:
            return []
    return sorted(cls.model_fields)


def _inner_model(ann: Any) -> Any:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in get_args(ann):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _pydantic_errors(exc: ValidationError, prefix: str, model: type[BaseModel]) -> list[str]:
    lines = []
    for err in exc.errors():
        # Pydantic puts union-member tags (``str``, ``list[str]``, ``function-after[...]``) into the
        # location; drop them so the path reads like the config the user wrote.
        loc = [p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))]
        msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        # An unknown key is most often a typo, so name every valid key at that level.
        if err["type"] == "extra_forbidden" and loc:
            bad = loc.pop()
            msg = f"unknown key {bad!r}; valid keys: {', '.join(_valid_keys(model, loc))}"
        elif err["type"] == "missing":
            field_name = loc.pop() if loc else "value"
            msg = f"{field_name} is a required property"
        elif (
            "input" in err
            # Our own validators already name the bad value, and echoing a whole mapping or list would
            # flood the line, so only scalar inputs are appended.
            and err["type"] not in ("value_error", "assertion_error")
            and not isinstance(err["input"], (dict, list))
        ):
            msg = f"{msg}, got {err['input']!r}"
        lines.append(f"{_loc(prefix, loc)}: {msg}")
    return lines


def _model(cls: type[BaseModel], data: Any, prefix: str, errors: list[str]) -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        errors.extend(_pydantic_errors(e, prefix, cls))
        return None


@dataclass(frozen=True)
class ExperimentConfig:
    """A validated config with defaults filled: what code downstream of validation receives.

    The typed parts are the truth; ``as_dict()`` is the plain JSON form that the store keeps and
    trials see (``DET_EXPERIMENT_CONFIG``), in its one canonical order (see :func:`validate`). A
    config read back from the store goes through :func:`from_stored`, so a hand-edited row is
    validated again before it can reach a script.
    """

    top: s.TopLevel
    searcher: s.SearcherConfig
    storage: s.StorageConfig
    hyperparameters: dict[str, Any]
    _dict: dict[str, Any] = field(repr=False, default_factory=dict)

    # A fresh copy each call: callers store or mutate it, and the frozen config must not change.
    def as_dict(self) -> dict[str, Any]:
        copy: dict[str, Any] = json.loads(json.dumps(self._dict))
        return copy

    @property
    def name(self) -> str:
        return self.top.name or "Experiment"

    @property
    def entrypoint(self) -> str | list[str]:
        ep = self.top.entrypoint
        assert ep is not None
        return ep

    @property
    def resources(self) -> s.Resources:
        return self.top.resources

    @property
    def environment(self) -> s.Environment:
        return self.top.environment

    @property
    def slurm(self) -> s.SlurmSection:
        return self.top.slurm

    @property
    def max_restarts(self) -> int:
        return self.top.max_restarts

    @property
    def storage_base(self) -> str:
        """Where this experiment's checkpoints go (the one place that knows the storage types)."""
        return self.storage.base_path()

    @property
    def legacy_max_length(self) -> s.Length | None:
        return self.searcher.max_length


# Every config this process validated, by the content of its stored form: validating that form
# again gives the same config (see validate), so reading it back from the store needs no second
# validation, whether this process stored it (a create, an edit) or read it before (the daemon
# reads the same configs every tick). A row changed since, by hand or by another user of a shared
# database, has other content and is validated as any other.
_VALIDATED: OrderedDict[str, ExperimentConfig] = OrderedDict()
_VALIDATED_KEPT = 256
_VALIDATED_LOCK = threading.Lock()  # the dashboard reads configs from several threads


def _content_key(data: Mapping[str, Any]) -> str:
    return json.dumps(data, sort_keys=True)


def _remember(key: str, config: ExperimentConfig) -> None:
    with _VALIDATED_LOCK:
        _VALIDATED[key] = config
        while len(_VALIDATED) > _VALIDATED_KEPT:
            _VALIDATED.popitem(last=False)


def from_stored(data: Mapping[str, Any], where: str = "stored config") -> ExperimentConfig:
    """Validate a config read back from the store (plain JSON) into its typed form.

    A config this process validated already (see ``_VALIDATED``) is returned as it is. A row
    that does not validate (edited by hand, or by another user of a shared database) raises
    ConfigError.
    """
    key = _content_key(data)
    with _VALIDATED_LOCK:
        known = _VALIDATED.get(key)
        if known is not None:
            _VALIDATED.move_to_end(key)
            return known
    try:
        config = validate(json.loads(key))
    except ConfigError as e:
        raise ConfigError([line.replace(ROOT, where, 1) for line in e.errors]) from None
    # Kept by the row's content too: a row stored before a default was added validates to more
    # than it holds, and must not be validated again at every read.
    _remember(key, config)
    return config


def _sorted_maps(value: Any) -> Any:
    """``value`` with the keys of every mapping in it sorted, at every depth (lists keep their
    order): the order a config has once the store's read-back (``from_stored``) has sorted it."""
    if isinstance(value, Mapping):
        return {k: _sorted_maps(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list):
        return [_sorted_maps(v) for v in value]
    return value


def _check_searcher(raw: Any, hparams: dict[str, Any], errors: list[str]) -> Any:
    where = f"{ROOT}.searcher"
    if raw is None:
        errors.append(f"{ROOT}: searcher is a required property")
        return None
    if not isinstance(raw, dict):
        errors.append(f"{where}: must be a mapping, got {_kind(raw)}")
        return None
    name = raw.get("name")
    # Determined's AssertCurrent message for end-of-life searchers, kept verbatim so old configs
    # fail with the wording users will search for.
    if name in s.REMOVED_SEARCHERS:
        errors.append(f"{where}.name: the '{name}' searcher has been removed and is not valid for new experiments")
        return None
    cls = s.SEARCHERS.get(name) if isinstance(name, str) else None
    if cls is None:
        valid = ", ".join(repr(n) for n in s.SEARCHERS)
        errors.append(f"{where}.name: must be one of {valid}, got {name!r}")
        return None
    sc = _model(cls, raw, where, errors)
    if sc is None:
        return None
    # Determined's "eventually required" fields: optional in the schema, checked once defaults are
    # filled, with its "is a required property" wording.
    if not sc.metric:
        errors.append(f"{where}: metric is a required property")
    if name in ("random", "adaptive_asha") and sc.max_trials is None:
        errors.append(f"{where}: max_trials is a required property")
    # The 0.37 form (max_length) is still accepted; 0.38 requires max_time plus time_metric instead.
    if name == "adaptive_asha" and sc.max_length is not None and sc.max_time is not None and not sc.time_metric:
        # max_time counts in units of time_metric: without it the first validation has no time.
        errors.append(f"{where}: time_metric is required when max_time is set")
    if name == "adaptive_asha" and sc.max_length is None and (sc.max_time is None or not sc.time_metric):
        # Determined's wording, plus the 0.37 form it still accepts: a user porting an old config
        # looks for the key they know.
        errors.append(
            f"{where}: the `adaptive_asha` searcher requires `max_time` and `time_metric` to be set "
            "(or, in the 0.37 form Determined 0.38 still accepts, `max_length`)"
        )
    if name == "grid":
        # Grid needs a count on every numeric hparam; only_grid keeps the generic errors, already
        # reported by validate(), from appearing twice.
        errors.extend(check_hyperparameters(hparams, f"{ROOT}.hyperparameters", grid=True, only_grid=True))
    return sc


def _check_storage(raw: Any, default: Mapping[str, Any] | None, errors: list[str]) -> Any:
    where = f"{ROOT}.checkpoint_storage"
    if raw is None:
        # The site config may supply a default storage, so users of one cluster need not repeat it.
        raw = dict(default) if default else None
    if raw is None:
        errors.append(f"{ROOT}: checkpoint_storage is a required property")
        return None
    # Determined's string shortcut: a bare path means shared_fs rooted at that path.
    if isinstance(raw, str):
        raw = {"type": "shared_fs", "host_path": raw}
    if not isinstance(raw, dict):
        errors.append(f"{where}: must be a mapping, got {_kind(raw)}")
        return None
    typ = raw.get("type")
    # Valid in Determined but deliberately unsupported: trials only reach the shared filesystem.
    if typ in ("s3", "gcs", "azure"):
        errors.append(f"{where}.type: {typ} storage is not supported by detslurm; use shared_fs or directory")
        return None
    cls = s.STORAGES.get(typ) if isinstance(typ, str) else None
    if cls is None:
        errors.append(f"{where}.type: must be one of 'shared_fs', 'directory', got {typ!r}")
        return None
    st = _model(cls, raw, where, errors)
    if st is not None and typ == "shared_fs" and not st.host_path:
        errors.append(f"{where}: host_path is a required property")
    return st


def _check_top(top: s.TopLevel, errors: list[str]) -> None:
    if top.entrypoint is None or top.entrypoint == "" or top.entrypoint == []:
        errors.append(f"{ROOT}: entrypoint is a required property (managed experiments require entrypoint)")
    env = top.environment
    ev = env.environment_variables
    kinds = ev if isinstance(ev, dict) else {"": ev}
    for kind, items in kinds.items():
        base = f"{ROOT}.environment.environment_variables" + (f".{kind}" if kind else "")
        for i, item in enumerate(items):
            key, sep, value = item.partition("=")
            # The name is exported in the sbatch script, so it must be a shell identifier; anything else
            # would be rejected by the shell only after the job has waited in the queue.
            if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                errors.append(f"{base}[{i}]: expected NAME=VALUE with a valid variable name, got {item!r}")
            elif key in ckpt_settings.CHECKS:
                # detslurm's own checkpoint settings, checked now rather than by the queued trial.
                try:
                    ckpt_settings.CHECKS[key]({key: value})
                except ValueError as e:
                    errors.append(f"{base}[{i}]: {e}")


# Determined names an unnamed experiment "Experiment (<petname>)"; two small word lists give the
# same shape without a petname dependency.
_PET_A = ["brave", "calm", "eager", "fancy", "gentle", "happy", "jolly", "kind", "lively", "proud", "quick", "witty"]
_PET_B = ["otter", "falcon", "badger", "heron", "lynx", "marten", "osprey", "panda", "raven", "tapir", "wombat", "yak"]


def validate(raw: Mapping[str, Any], default_storage: Mapping[str, Any] | None = None) -> ExperimentConfig:
    """The typed config of ``raw`` with defaults filled, or ConfigError listing every problem.

    The result is canonical: the free-form maps (``data``, ``hyperparameters``, ...) have their
    keys sorted and the rest is in the schema's order, so validating its stored form
    (``as_dict()``) again gives an equal config in the same order. The store, the dry run, the
    first submission and every later one from the store all see that one form.
    """
    if isinstance(raw, Mapping):
        raw = _sorted_maps(raw)
    errors: list[str] = []
    top = _model(s.TopLevel, dict(raw), ROOT, errors)
    hp_raw = raw.get("hyperparameters", {}) if isinstance(raw, Mapping) else {}
    hparams: dict[str, Any] = {}
    if hp_raw is None:
        hp_raw = {}
    if not isinstance(hp_raw, dict):
        errors.append(f"{ROOT}.hyperparameters: must be a mapping, got {_kind(hp_raw)}")
    else:
        hp_errors = check_hyperparameters(hp_raw, f"{ROOT}.hyperparameters")
        errors.extend(hp_errors)
        if not hp_errors:
            # Sorted again: normalising adds keys (a log hparam's base) after the user's.
            hparams = _sorted_maps(normalize_hyperparameters(hp_raw))
    # With hparam errors already reported, the grid count check would repeat them on broken input.
    searcher = _check_searcher(raw.get("searcher"), hp_raw if not errors else {}, errors)
    storage = _check_storage(raw.get("checkpoint_storage"), default_storage, errors)
    if top is not None:
        _check_top(top, errors)
    slurm = raw.get("slurm") if isinstance(raw, Mapping) else None
    sargs = slurm.get("sbatch_args") if isinstance(slurm, dict) else None
    if isinstance(sargs, list) and all(isinstance(a, str) for a in sargs):
        # Only a well-typed list is checked here; a wrong type is already reported by the TopLevel model.
        errors.extend(check_sbatch_args(sargs, f"{ROOT}.slurm.sbatch_args"))
    if errors:
        # Sorted and de-duplicated, as Determined prints them, so every problem shows in one run.
        raise ConfigError(sorted(set(errors)))
    assert top is not None
    if top.name is None:
        rng = random.Random()
        top.name = f"Experiment ({rng.choice(_PET_A)}-{rng.choice(_PET_B)})"
    full = top.model_dump(mode="json")
    full["searcher"] = searcher.model_dump(mode="json", exclude_none=False)
    if searcher.max_length is not None:
        # model_dump would write all three units with two of them null; store the one-key form the
        # user wrote.
        full["searcher"]["max_length"] = searcher.max_length.to_json()
    full["checkpoint_storage"] = storage.model_dump(mode="json")
    full["hyperparameters"] = hparams
    for key in ("min_validation_period", "min_checkpoint_period"):
        full[key] = getattr(top, key).to_json()
    # The three sections validated on their own keep their stored form at the top level too, as
    # validating that form again gives them: the two configs are equal in every part.
    top.searcher, top.checkpoint_storage = json.loads(json.dumps([full["searcher"], full["checkpoint_storage"]]))
    top.hyperparameters = json.loads(json.dumps(hparams))
    config = ExperimentConfig(top=top, searcher=searcher, storage=storage, hyperparameters=hparams, _dict=full)
    _remember(_content_key(full), config)
    return config


def load_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    default_storage: Mapping[str, Any] | None = None,
) -> tuple[ExperimentConfig, str]:
    """Read, override and validate a config file; returns it and the original YAML text."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError([f"{p}: cannot read the experiment config: {e.strerror}"]) from None
    try:
        raw = apply_overrides(parse_yaml(text), overrides)
        return validate(raw, default_storage), text
    except ConfigError as e:
        raise e.in_file(str(path)) from None
