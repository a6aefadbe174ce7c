"""The node: its CPUs and NUMA domains, the hosts of a job, and which CPUs each rank gets."""
