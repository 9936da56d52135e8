"""In-job launchers (installed as detslurm.launch): torch_distributed, deepspeed, horovod, wrap_rank.

They run once per node inside a trial's Slurm allocation (or once, locally) and need no master,
no ssh and no daemon: every peer detail comes from SLURM_* variables and the shared run dir.
Stdlib only, so that starting one costs nothing next to the framework it launches.
"""
