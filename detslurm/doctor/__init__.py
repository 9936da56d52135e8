"""`det site doctor` and `det site init`: what a Slurm site offers detslurm, checked.

Facts are probed once (``facts``: the controller's config, partitions, limits; ``probe``: one
job per pool that reports what only a compute node can tell), then judged by pure checks
(``checks``, ``node_checks``) into :class:`~detslurm.doctor.findings.Finding` lines that say ok,
warning or problem and what detslurm will do about it.
"""
