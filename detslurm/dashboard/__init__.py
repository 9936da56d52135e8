"""`det dashboard`: a read-only web view of the store (experiments, trials, metric curves,
checkpoints, logs, the job queue and the resource pools), served on 127.0.0.1 with a token.

An extra (``pip install 'detslurm[dashboard]'``): starlette and uvicorn are imported only by
:mod:`detslurm.dashboard.server`, never by the rest of detslurm. The queries
(:mod:`detslurm.dashboard.queries`) and the downsampling (:mod:`detslurm.dashboard.downsample`)
need neither, so they can be tested and benchmarked without a web server."""
