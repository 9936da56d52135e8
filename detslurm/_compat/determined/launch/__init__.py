"""`python3 -m determined.launch.X` maps to detslurm.launch.X (added with the launchers)."""
