"""``train --help`` states the engine's defaults as the code has them."""

from __future__ import annotations


def test_the_progress_help_names_each_familys_default():
    """``train --help`` says which progress each MPI family gets by default, as
    ``allreduce.PROGRESS`` has it (it said MPICH: thread while the engine used hook)."""
    from hpcai.training.allreduce import PROGRESS
    from hpcai.training.config import make_parser

    text = " ".join(make_parser().format_help().split())
    by_progress: dict[str, list[str]] = {}
    for family, title in (("openmpi", "Open MPI"), ("mpich", "MPICH"), ("intel", "Intel MPI")):
        by_progress.setdefault(PROGRESS[family], []).append(title)
    said = "; ".join(f"{' and '.join(titles)}: {progress}"
                     for progress, titles in by_progress.items())
    assert f"({said})" in text, (said, text[text.find("default: the MPI"):][:200])
