"""Fuzzed experiment configs: every outcome is a valid config or a clean ConfigError, never a
traceback. Values are drawn around the real schema so that the
validator's deeper paths (searchers, hyperparameters, storage, sbatch args) are reached."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detslurm.errors import ConfigError
from detslurm.expconf import apply_overrides, parse_yaml, validate

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.just("1e-3"),
    st.just("$(touch x)"),
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
hp = st.one_of(
    scalars,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["int", "double", "log", "categorical", "const", "x"])},
        optional={
            "minval": scalars,
            "maxval": scalars,
            "count": scalars,
            "base": scalars,
            "vals": anything,
            "val": anything,
        },
    ),
    st.dictionaries(st.text(max_size=6), scalars, max_size=3),
)
searcher = st.fixed_dictionaries(
    {"name": st.sampled_from(["single", "random", "grid", "adaptive_asha", "custom", "bayes", 3])},
    optional={
        "metric": scalars,
        "max_trials": scalars,
        "max_time": scalars,
        "time_metric": scalars,
        "max_length": st.one_of(scalars, st.dictionaries(st.sampled_from(["batches", "epochs", "x"]), scalars)),
        "divisor": scalars,
        "mode": scalars,
        "max_concurrent_trials": scalars,
        "smaller_is_better": scalars,
    },
)
config = st.fixed_dictionaries(
    {},
    optional={
        "entrypoint": st.one_of(scalars, st.lists(st.text(max_size=8), max_size=3)),
        "searcher": st.one_of(searcher, anything),
        "hyperparameters": st.one_of(st.dictionaries(st.text(min_size=1, max_size=6), hp, max_size=4), anything),
        "resources": st.one_of(
            anything,
            st.fixed_dictionaries(
                {}, optional={"slots_per_trial": scalars, "resource_pool": scalars, "slots": scalars}
            ),
        ),
        "checkpoint_storage": st.one_of(
            anything,
            st.fixed_dictionaries(
                {"type": st.sampled_from(["shared_fs", "directory", "s3", 1])},
                optional={"host_path": scalars, "storage_path": scalars, "container_path": scalars},
            ),
        ),
        "slurm": st.one_of(
            anything,
            st.fixed_dictionaries(
                {},
                optional={
                    "sbatch_args": st.lists(
                        st.sampled_from(["-N2", "--qos=x", "--gres=gpu:1", "a\nb", "--time=5"]), max_size=3
                    ),
                    "slots_per_node": scalars,
                },
            ),
        ),
        "max_restarts": scalars,
        "name": scalars,
        "bind_mounts": anything,
        "environment": anything,
        "min_validation_period": anything,
        "reproducibility": anything,
        "bogus": anything,
    },
)


def _check(raw: Any) -> None:
    try:
        cfg = validate(raw, {"type": "shared_fs", "host_path": "/tmp/ck"})
    except ConfigError as e:
        assert e.errors and all(isinstance(x, str) and x.startswith(("<config>", "--config")) for x in e.errors)
        return
    yaml.safe_dump(cfg.as_dict())  # a valid config round-trips


@pytest.mark.heavy
@pytest.mark.fault
@settings(max_examples=1200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config)
def test_fuzzed_configs_give_clean_errors(raw: dict[str, Any]) -> None:
    _check(raw)


@pytest.mark.fault
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_fuzzed_yaml_text(text: str) -> None:
    try:
        _check(parse_yaml(text))
    except ConfigError as e:
        assert e.errors[0].startswith("<config>")


@pytest.mark.fault
@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=20), max_size=4))
def test_fuzzed_overrides(items: list[str]) -> None:
    with contextlib.suppress(ConfigError):
        _check(apply_overrides({"entrypoint": "x", "searcher": {"name": "single", "metric": "m"}}, items))
