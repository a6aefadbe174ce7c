"""The order in which the whole suite's files are handed to the pytest-xdist workers.

``run-tests.sh`` gives each worker whole files (``--dist loadfile``), in collection order,
the next file to the first worker that is free. Alphabetical order would leave several of the
longest files (Slurm sweeps, TensorFlow, training) to the end, where one worker runs them
while the other has nothing left. The longest files go first instead (the longest-first rule
for scheduling jobs on identical machines); the order of tests within a file is kept. The
list holds the files whose tests took 2 minutes or more in all, longest first, in a whole
run on a 2-core VM (3 workers; commit f2ca4f7); the rest keep their alphabetical order
after them."""

from __future__ import annotations

import pytest

LONGEST_FIRST = (
    "test_faults.py", "test_tf_training.py", "test_validate.py", "test_sweep_slurm.py",
    "test_abi_matrix.py", "test_averaging.py", "test_export.py", "test_signals.py",
    "test_gpu_path.py", "test_learning_bench.py", "test_apptainer.py",
)


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: files of :data:`LONGEST_FIRST` in its order, then the
    others as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    position = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), position[id(item)]))
