"""Slurm's pure builders: the srun line, node and task lists, and what a step says about srun."""
