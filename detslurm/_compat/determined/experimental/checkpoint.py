"""``determined.experimental.checkpoint``: the SDK's checkpoint classes (also in ``client``)."""

from detslurm.client import Checkpoint, CheckpointOrderBy, CheckpointSortBy, CheckpointState, DownloadMode

__all__ = ["Checkpoint", "CheckpointOrderBy", "CheckpointSortBy", "CheckpointState", "DownloadMode"]
