"""Slurm: the srun line, the PMI plugin, node lists, batch scripts, sweeps and reports."""
