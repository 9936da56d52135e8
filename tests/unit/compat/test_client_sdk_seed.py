"""The checkpoint-loading snippet of Determined's PyTorch Trainer guide, run as written over the
store: ``path = client.get_checkpoint(uuid)``, then ``det.import_from_path(path + "/code/")``
imports the trial's code from the checkpoint and a CheckpointLoadContext rebuilds the trial.
(Under Determined itself ``Checkpoint + str`` is a TypeError; the guide means the download.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import write
from test_client_sdk import _experiment, sdk  # noqa: F401  (sdk: the fixture)

from detslurm import settings
from detslurm.expconf import from_stored
from detslurm.store import Experiment, open_store

MODEL_DEF = """
class MyTrial:
    def __init__(self, context, scale):
        self.context = context
        self.scale = scale
"""


def test_the_guides_snippet_imports_the_trials_code_from_a_checkpoint(
    sdk: Any,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exp_id, _, uuids = _experiment(tmp_path)
    with open_store(settings.load().db_url).read() as s:
        exp = s.get(Experiment, exp_id)
        assert exp is not None
        base = Path(from_stored(exp.config, "test").storage_base)
    write(base / uuids["a20"] / "code" / "my_model_def.py", MODEL_DEF)
    monkeypatch.chdir(tmp_path)

    import determined as det
    from determined import pytorch
    from determined.experimental import client

    path = client.get_checkpoint(uuids["a20"])
    with det.import_from_path(path + "/code/"):
        import my_model_def  # type: ignore[import-not-found]

    context = pytorch.CheckpointLoadContext()
    my_trial = my_model_def.MyTrial(context, scale=2)
    assert my_trial.scale == 2 and my_trial.context is context
    # The checkpoint was downloaded once, to ./checkpoints/<uuid>; a second use reuses it.
    assert path + "/code/" == f"checkpoints/{uuids['a20']}/code/"
    assert (tmp_path / "checkpoints" / uuids["a20"] / "w.txt").read_text() == "weights 20"
    with pytest.raises(TypeError):
        path + 3  # type: ignore[operator]
