"""Slurm helpers: a private local cluster for tests and trials (`localcluster`)."""
