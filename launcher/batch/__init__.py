"""Batch work: Slurm job scripts, sweeps over job shapes, and the reports of their results."""
