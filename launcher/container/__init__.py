"""Containers: runtime records, pre-flight checks, the image's MPI consumers, host libraries staged
for a read-only bind, and the container part of a plan."""
