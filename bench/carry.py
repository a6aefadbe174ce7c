"""Carry a long learning benchmark from one machine to the next (issue 17).

A three-seed run of ``bench/learning.py`` takes longer than one sitting, and a machine's
``/tmp`` may not outlive the sitting. ``save`` keeps what a resume needs of every seed's run
directory in a folder of the checkout (committed), ``restore`` puts it back on a fresh
machine, and ``bench/learning.py --train-arg=--resume`` then continues every seed:

    python bench/carry.py save WORKDIR STATE       # STATE/seedN/ for every WORKDIR/seedN/
    python bench/carry.py restore STATE WORKDIR

Per seed ``save`` keeps the newest checkpoint (older ones it kept before are removed), the
run's records (``epochs.jsonl``, ``steps.jsonl``, ``physics.json``) and ``data.json``: every
data file's name, events and SHA-256. Save a run that has stopped (SIGUSR1 to its job: a
checkpoint, then exit), so that its records end where its checkpoint does.

The data itself is not kept: ``train --generate`` wrote it with ``showers.generate`` from
its seed, and ``restore`` writes it again the same way and compares every file's SHA-256
with ``data.json``, so the resumed run trains and validates on the very files it started
with. A seed is restored into a new directory only (never over a run), built beside it and
renamed into place when every file checked out; on a mismatch nothing of that seed is left
behind (seeds restored before it stay) and the exit status is 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from hpcai.core.errors import UserError
from hpcai.training.atomic import replacing
from hpcai.training.checkpoint import list_checkpoints

KEPT = ("epochs.jsonl", "steps.jsonl", "physics.json")   # beside the newest checkpoint
MANIFEST = "data.json"
DATA_NAME = re.compile(r"Ele_(\d+)_(\d+)\.h5$")   # showers.generate's file names


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_manifest(data: Path) -> list[dict]:
    """Name, events and SHA-256 of every generated file in ``data`` (sorted by name)."""
    import h5py

    files = []
    for path in sorted(data.iterdir()):
        if not DATA_NAME.fullmatch(path.name):
            continue
        with h5py.File(path, "r") as h5:
            events = int(h5["ECAL"].shape[0])
        files.append({"name": path.name, "events": events, "sha256": sha256(path)})
    return files


def _copy(src: Path, dst: Path) -> None:
    """``src`` over ``dst``, whole or not at all."""
    with replacing(dst) as tmp:
        shutil.copyfile(src, tmp)


def seed_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"seed\d+", p.name))


def save(workdir: Path, state: Path) -> list[str]:
    """Keep what a resume needs of every ``WORKDIR/seedN`` with a checkpoint in
    ``STATE/seedN``; returns one line per seed saved."""
    if not workdir.is_dir() or not seed_dirs(workdir):
        raise UserError(f"{workdir}: no seedN run directory", "name bench/learning.py's --workdir")
    lines = []
    for run in seed_dirs(workdir):
        checkpoints = list_checkpoints(run / "checkpoints")
        if not checkpoints:
            continue
        newest = checkpoints[-1]
        out = state / run.name
        out.mkdir(parents=True, exist_ok=True)
        _copy(newest, out / newest.name)
        for old in list_checkpoints(out):
            if old.name != newest.name:
                old.unlink()
        for name in KEPT:
            if (run / name).exists():
                _copy(run / name, out / name)
        manifest = {"files": data_manifest(run / "data")}
        with replacing(out / MANIFEST) as tmp:
            tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        lines.append(f"{run.name}: {newest.name}, {len(manifest['files'])} data files")
    return lines


def regenerate(files: list[dict], data: Path) -> None:
    """Write ``files`` (a manifest) again into ``data`` with ``showers.generate`` and check
    each one's SHA-256; raises :class:`UserError` on a file it cannot make the same."""
    from hpcai.training.showers import generate

    by_seed: dict[int, list[tuple[int, dict]]] = {}   # seed: (file index, manifest entry)
    for f in files:
        m = DATA_NAME.fullmatch(f["name"])
        if m is None:
            raise UserError(f"{f['name']}: not a generated file's name",
                            "only runs of train --generate can be carried")
        by_seed.setdefault(int(m.group(1)), []).append((int(m.group(2)), f))
    for seed, group in by_seed.items():
        events = {f["events"] for _, f in group}
        if len(events) != 1 or sorted(i for i, _ in group) != list(range(len(group))):
            raise UserError(f"the files of seed {seed} are not one generate() call's",
                            "only runs of train --generate can be carried")
        generate(data, n_files=len(group), events_per_file=events.pop(), seed=seed)
    for f in files:
        got = sha256(data / f["name"])
        if got != f["sha256"]:
            raise UserError(f"{f['name']} written again differs from the one the run trained "
                            f"on (SHA-256 {got[:12]}, saved {f['sha256'][:12]})",
                            "this machine's NumPy or HDF5 writes other bytes: resume where "
                            "the run started, or carry the data files too")


def restore(state: Path, workdir: Path) -> list[str]:
    """Put every ``STATE/seedN`` back as ``WORKDIR/seedN``, its data written again and
    checked; returns one line per seed restored."""
    seeds = seed_dirs(state) if state.is_dir() else []
    if not seeds:
        raise UserError(f"{state}: no seedN folder", "name the folder `carry.py save` wrote")
    for saved in seeds:
        if (workdir / saved.name).exists():
            raise UserError(f"{workdir / saved.name} exists",
                            "restore into a work directory without that seed; to continue "
                            "a run that is there, resume it as it is")
    workdir.mkdir(parents=True, exist_ok=True)
    lines = []
    for saved in seeds:
        checkpoints = list_checkpoints(saved)
        manifest = saved / MANIFEST
        if len(checkpoints) != 1 or not manifest.exists():
            raise UserError(f"{saved}: needs one checkpoint and {MANIFEST}",
                            "name the folder `carry.py save` wrote")
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        build = Path(tempfile.mkdtemp(prefix=f".{saved.name}.", dir=workdir))
        try:
            (build / "checkpoints").mkdir()
            shutil.copyfile(checkpoints[0], build / "checkpoints" / checkpoints[0].name)
            for name in KEPT:
                if (saved / name).exists():
                    shutil.copyfile(saved / name, build / name)
            (build / "data").mkdir()
            regenerate(files, build / "data")
            os.replace(build, workdir / saved.name)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
        lines.append(f"{saved.name}: {checkpoints[0].name}, {len(files)} data files "
                     "written again, every SHA-256 as saved")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("save", help="keep what a resume needs in STATE")
    s.add_argument("workdir", type=Path)
    s.add_argument("state", type=Path)
    r = sub.add_parser("restore", help="put STATE back as a work directory")
    r.add_argument("state", type=Path)
    r.add_argument("workdir", type=Path)
    args = p.parse_args(argv)
    try:
        lines = (save(args.workdir, args.state) if args.command == "save"
                 else restore(args.state, args.workdir))
    except UserError as exc:   # generate()'s own (an unwritable folder) among them
        print(exc.render(), file=sys.stderr)
        return 2
    print("\n".join(lines) if lines else "nothing to save: no seed has a checkpoint yet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
