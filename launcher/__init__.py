"""hpcai-launch: plan and start MPI training ranks with NUMA-aware placement."""
