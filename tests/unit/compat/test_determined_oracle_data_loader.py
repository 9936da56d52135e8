"""``det.pytorch.DataLoader.get_data_loader(repeat, skip, num_replicas, rank)`` and iterating a
DataLoader directly, run by the real determined 0.38.1 and by us over the same in-order data:
the batches each rank sees must be the same."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from determined_oracle import oracle_python, record_script

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

SCRIPT = r"""
import itertools, json, sys
import torch
from determined import pytorch

data = torch.arange(11)
out = {}
for bs, drop in ((3, False), (3, True), (4, False)):
    loader = pytorch.DataLoader(data, batch_size=bs, drop_last=drop)
    out[f"len-{bs}-{drop}"] = len(loader)
    out[f"iter-{bs}-{drop}"] = [b.tolist() for b in loader]
    for replicas, rank, skip in ((1, 0, 0), (2, 0, 0), (2, 1, 0), (2, 1, 1), (3, 2, 1)):
        once = loader.get_data_loader(skip=skip, num_replicas=replicas, rank=rank)
        out[f"once-{bs}-{drop}-{replicas}-{rank}-{skip}"] = [b.tolist() for b in once]
        forever = loader.get_data_loader(repeat=True, skip=skip, num_replicas=replicas, rank=rank)
        out[f"repeat-{bs}-{drop}-{replicas}-{rank}-{skip}"] = [b.tolist() for b in itertools.islice(forever, 7)]
json.dump(out, open(sys.argv[1], "w"), sort_keys=True)
"""


def test_get_data_loader_shards_skips_and_repeats_as_determined(tmp_path: Path) -> None:
    theirs = record_script(oracle_python(), SCRIPT, tmp_path / "determined")
    ours = record_script(sys.executable, SCRIPT, tmp_path / "detslurm")
    assert theirs["repeat-3-False-2-1-1"] == [[9, 10], [3, 4, 5], [9, 10], [3, 4, 5], [9, 10], [3, 4, 5], [9, 10]]
    assert ours == theirs, "\n".join(
        f"{k}: Determined {theirs.get(k)!r}, detslurm {ours.get(k)!r}"
        for k in sorted({*theirs, *ours})
        if theirs.get(k) != ours.get(k)
    )


def test_get_data_loader_refuses_a_rank_outside_the_replicas() -> None:
    import torch

    from detslurm import pytorch

    with pytest.raises(ValueError, match="rank 2 is not one of num_replicas=2"):
        pytorch.DataLoader(torch.arange(4)).get_data_loader(num_replicas=2, rank=2)
