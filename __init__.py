"""hpcai: an MPI-native distributed training launcher for HPC sites."""

__version__ = "0.1.0"
