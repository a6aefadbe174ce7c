"""The training loop, one object per rank, for every framework (imported once MPI may start).

Per step: this rank's shard of a seed-shuffled epoch order, the task's step with gradients
averaged across ranks, a cheap replica check every K steps, a collective look at the
preemption flag. Per epoch: BatchNorm statistics handled as asked, replicas verified, the
3DGAN's physics validation on held-out files when due (``validation.py``), one
:class:`~.record.EpochRecord` (time split, samples/s, FLOP rate, % of peak, provenance) and
an atomic checkpoint. From the first step to the end, each phase is marked for the stall
watchdog (``watchdog.py``), in the same order on every rank.

This module imports no framework: what differs between PyTorch (``torch_trainer``) and
TensorFlow (``tf_trainer``) are the hooks below, which their subclasses implement.
"""

from __future__ import annotations

import json
import os
import resource
import time
import zlib
from abc import ABC, abstractmethod
from typing import BinaryIO

import numpy as np
from mpi4py import MPI

from ..core.errors import UserError

from . import checkpoint, recipes
from .batches import BatchStream, EpochSharder
from .config import TrainConfig, changed_settings
from .console import Progress, epoch_line, worst_bin
from .faults import EXIT_PREEMPTED, Preemption
from .inputs import Checked
from .metrics import provenance
from .record import AllreduceTotals, EpochRecord, Peak, Provenance
from .replicas import verify
from .schedule import learning_rate
from .shower_data import ShowerReader, split_files, validate
from .showers import generate, held_out_seed
from .synthetic_images import SyntheticImages
from .physics_plots import write_plots
from .validation import (PhysicsValidator, PlotClock, due, plots_behind,
                         record as record_physics, redraw)
from .waits import idle_barrier
from .watchdog import Watchdog

STATE_VERSION = 1   # of the checkpoint's contents
_STEP_KEYS = ("epoch", "step", "lr")   # a steps.jsonl line: these, then the step's losses


def _max_rss_mb() -> float:
    """This process's peak resident set size so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step_seed(seed: int, rank: int, epoch: int, step: int) -> int:
    """Per-rank, per-step RNG seed: a resumed run draws the very same noise."""
    return zlib.crc32(f"{seed}:{rank}:{epoch}:{step}".encode())


class Trainer(ABC):
    framework: str   # "pytorch" or "tensorflow": records, checkpoints, messages

    def __init__(self, cfg: TrainConfig, comm, checked: Checked,
                 preemption: Preemption) -> None:
        self.cfg, self.comm = cfg, comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.preemption = preemption
        self.resume_from = checked.resume_from
        self.note = checked.note
        self.watch = Watchdog(comm, cfg.stall_timeout)
        self.threads = self._threads()
        self.data, self.sharder, held_out = self._data(checked.index, checked.held_out)
        self.validator = (PhysicsValidator(held_out, cfg.validate_events, cfg.seed, comm,
                                           cfg.validate_draws)
                          if held_out is not None and cfg.validate_events > 0 else None)
        self.plots = PlotClock(   # rank 0's redrawing of the physics plots
            behind=self.rank == 0 and self.validator is not None and cfg.resume
            and plots_behind(cfg.out_dir))
        self.base_lr = cfg.lr
        self.target_lr = cfg.lr * (self.world if cfg.lr_scaling == "linear" else 1)
        self.task = self._make_task()
        self.comm_backend = cfg.comm   # what averages the gradients; a hook may fall back
        self.comm_detail = ""          # how, where the start line says more (e.g. progress)
        self.reducers = self._make_reducers()
        self.global_step = 0
        self.start_epoch, self.start_step = 0, 0
        self.steps = (min(self.sharder.steps_per_epoch, cfg.max_steps) if cfg.max_steps
                      else self.sharder.steps_per_epoch)
        if self.steps < 1:
            raise UserError(
                f"{len(self.data)} samples are too few for one step of {cfg.batch_size} x "
                f"{self.world} ranks", "generate more data or lower --batch-size")

    # -- framework hooks ------------------------------------------------------------------
    @abstractmethod
    def _threads(self) -> int:
        """Intra-op threads of this rank."""

    @abstractmethod
    def _make_task(self):
        """The model as a task: ``train_step(x, y, rng, gradients)``, ``evaluate(x, y)``
        (NumPy batches), ``flops_per_sample()``, ``flop_convention``, ``loss_keys`` (the losses
        the epoch line shows)."""

    @abstractmethod
    def _make_reducers(self) -> dict:
        """The gradient averagers (each with ``stats``: :class:`~.sync.SyncStats`)."""

    @abstractmethod
    def _gradients(self, *args):
        """The task's gradient callback, before each optimiser step: the averaged gradients
        (PyTorch: the backward of the divided loss and the allreduce it overlaps; TensorFlow:
        the allreduce of gradients computed)."""

    @abstractmethod
    def _broadcast(self) -> None:
        """Overwrite every rank's model state with rank 0's."""

    @abstractmethod
    def _state_arrays(self, everything: bool) -> list[np.ndarray]:
        """The model state as NumPy arrays: the trainable weights, and with ``everything``
        the BatchNorm statistics too."""

    @abstractmethod
    def _average_bn(self) -> None:
        """Replace BatchNorm statistics by their mean over ranks."""

    @abstractmethod
    def _local_statistics(self) -> list:
        """This rank's BatchNorm moving statistics, as the checkpoint stores them."""

    @abstractmethod
    def _load_local_statistics(self, saved: list) -> None:
        """Put back what :meth:`_local_statistics` gave (as many as it gives)."""

    @abstractmethod
    def _apply_lr(self, lr: float) -> None:
        ...

    @abstractmethod
    def _task_state(self) -> dict:
        """{"modules": ..., "optimizers": ...} for the checkpoint."""

    @abstractmethod
    def _load_task_state(self, state: dict) -> None:
        ...

    @abstractmethod
    def _write_checkpoint(self, state: dict, handle: BinaryIO) -> None:
        ...

    @abstractmethod
    def _step_rng(self, seed: int):
        """The generator the task draws a step's randomness from."""

    @abstractmethod
    def _gemm_probe(self) -> tuple[float, str]:
        """(GFLOP/s of this rank's best fp32 GEMM, what was measured)."""

    @abstractmethod
    def _framework_version(self) -> str:
        ...

    def _finish_device_work(self) -> None:
        """Wait until the accelerator has done all the work queued so far (the epoch's time
        ends here); nothing to wait for on the CPU."""

    def _to_host(self, values: list) -> list[float]:
        """The step losses as floats. A task may return values the device still computes
        (PyTorch on a GPU); they are read here, once per epoch or checkpoint."""
        return [float(v) for v in values]

    # -- set-up ---------------------------------------------------------------------------
    def _data(self, index, held_out):
        """(training data, its sharder, the held-out 3DGAN files or None)."""
        cfg = self.cfg
        if cfg.model == "3dgan":
            if index is None:
                index, held_out = self._generate()
            data = ShowerReader(index)
        else:
            data = SyntheticImages(cfg.samples, cfg.image_size, cfg.classes, seed=cfg.seed)
        sharder = EpochSharder(len(data), self.world, self.rank, cfg.batch_size, cfg.seed)
        return data, sharder, held_out

    def _generate(self):
        """--generate N: N training events (rounded up to equal files of at most 1000,
        Ele_SEED_i.h5) and ``--test-files`` held-out files of the same size (default 10 % of
        all files, at least 1) from their own seed, sorted last as ``split_files`` expects;
        rank 0 writes those missing. Returns (training, held-out)."""
        cfg = self.cfg
        target = cfg.out_dir / "data"
        n_train = -(-cfg.generate_events // 1000)
        per_file = -(-cfg.generate_events // n_train)
        n_test = max(1, n_train // 9) if cfg.test_files is None else cfg.test_files
        test_seed = held_out_seed(cfg.seed)
        train = [target / f"Ele_{cfg.seed}_{i}.h5" for i in range(n_train)]
        test = [target / f"Ele_{test_seed}_{i}.h5" for i in range(n_test)]
        if self.rank == 0:
            if not all(p.is_file() for p in train):
                generate(target, n_files=n_train, events_per_file=per_file, seed=cfg.seed)
            if test and not all(p.is_file() for p in test):
                generate(target, n_files=n_test, events_per_file=per_file, seed=test_seed)
        idle_barrier(self.comm)
        return split_files(validate(train + test), n_test)

    @property
    def comm_wait_s(self) -> float:
        return sum(r.stats.wait_s for r in self.reducers.values())

    # -- replicas, lr, checkpoints --------------------------------------------------------
    def _verify(self, exact: bool, what: str, buffers: bool | None = None) -> float:
        """Prove the replicas agree (see ``replicas.verify``): bit for bit when ``exact``,
        else within a tolerance; the weights, and the BatchNorm statistics with ``buffers``
        (default: when ``exact``). Returns the seconds it took."""
        start = time.perf_counter()
        if self.world > 1:
            verify(self._state_arrays(everything=exact if buffers is None else buffers),
                   self.comm, exact=exact, what=what)
        return time.perf_counter() - start

    def _set_lr(self, epoch: int, step: int) -> float:
        cfg = self.cfg
        lr = learning_rate(epoch * self.steps + step, cfg.epochs * self.steps,
                           cfg.warmup_epochs * self.steps, self.base_lr, self.target_lr,
                           cfg.lr_decay)
        self._apply_lr(lr)
        return lr

    def _state(self, epoch: int, step: int) -> dict:
        return {
            "version": STATE_VERSION,
            "model": self.cfg.model, "framework": self.framework,
            "epoch": epoch, "step": step, "global_step": self.global_step,
            "world_size": self.world, "batch_size": self.cfg.batch_size,
            "steps_per_epoch": self.steps, "config": self.cfg.to_dict(),
            **self._task_state(),
        }

    def _save(self, epoch: int, step: int, step_log: list) -> None:
        """Rank 0 appends the steps logged so far to steps.jsonl and writes the checkpoint of
        (epoch, step), with every rank's own BatchNorm statistics under ``--bn local``
        (gathered: they differ between ranks, and the 3DGAN's generator uses its own in the
        discriminator's fake step); all ranks meet at a barrier."""
        self.watch.enter("checkpoint write")
        self._flush_steps(step_log)
        per_rank = None
        if self.world > 1 and self.cfg.bn == "local":
            # at an epoch's end rank 0 validates, draws and evaluates first: wait asleep
            # for it, not polling in the gather
            idle_barrier(self.comm)
            per_rank = self.comm.gather(self._local_statistics(), root=0)
        if self.rank == 0:
            state = self._state(epoch, step)
            if per_rank is not None:
                state["rank_statistics"] = per_rank
            checkpoint.save(self.cfg.checkpoint_dir, state, epoch, step,
                            write=self._write_checkpoint, keep=self.cfg.keep)
        self.watch.enter("checkpoint barrier")
        idle_barrier(self.comm)

    def _synced(self, *args):
        """The task's gradient callback (:meth:`_gradients`), marked for the watchdog."""
        self.watch.enter("gradient allreduce")
        out = self._gradients(*args)
        self.watch.enter("step")
        return out

    def _resume(self) -> bool:
        """Load the checkpoint ``inputs.before_mpi`` read (``--resume``); none yet: start.
        True when each rank took back its own BatchNorm statistics (they differ)."""
        if self.resume_from is None:
            self._broadcast()
            if self.rank == 0:
                print(f"hpcai-train: --resume: no checkpoint yet in {self.cfg.checkpoint_dir}, "
                      "starting", flush=True)
            return False
        path, state = self.resume_from
        framework = state.get("framework", "pytorch")
        if framework != self.framework:
            raise UserError(f"checkpoint {path} was written by {framework}, this run is "
                            f"{self.framework}", "resume with the same --framework, or a new --out")
        if state.get("model") != self.cfg.model:
            raise UserError(f"checkpoint {path} is for {state.get('model')}, not "
                            f"{self.cfg.model}", "resume with the same model, or a new --out")
        if (state["world_size"], state["batch_size"]) != (self.world, self.cfg.batch_size):
            raise UserError(
                f"checkpoint {path} was written by {state['world_size']} ranks x batch "
                f"{state['batch_size']}, this run is {self.world} x {self.cfg.batch_size}",
                "resume with the same number of ranks and --batch-size (the data order "
                "depends on both)")
        self._load_task_state(state)
        per_rank = state.get("rank_statistics")
        if per_rank is not None:
            saved, mine = per_rank[self.rank], len(self._local_statistics())
            if len(saved) != mine:
                raise UserError(f"--resume: {path} holds {len(saved)} BatchNorm statistics "
                                f"per rank, this model has {mine}",
                                "resume with the model and options the run was started with")
            self._load_local_statistics(saved)
        elif self.world > 1 and self.cfg.bn == "local" and self.rank == 0:
            print(f"hpcai-train: --resume: {path} holds rank 0's BatchNorm statistics only "
                  "(written before per-rank ones were kept): every rank continues with them",
                  flush=True)
        # a stop after an epoch's last step leaves (epoch, steps): that epoch's end (its
        # record, validation and checkpoint) was not reached, so the resumed run does it first
        self.start_epoch, self.start_step = state["epoch"], min(state["step"], self.steps)
        self.global_step = state["global_step"]
        if self.rank == 0:
            done = (" (its steps are done: the epoch's end, validation included, comes first)"
                    if self.start_step == self.steps else "")
            print(f"hpcai-train: resumed from {path} at epoch {self.start_epoch} step "
                  f"{self.start_step}{done}", flush=True)
            changed = changed_settings(state.get("config", {}), self.cfg.to_dict())
            if changed:
                print("hpcai-train: --resume: these settings differ from the checkpoint's "
                      "and apply from here on: " + "; ".join(changed), flush=True)
        return per_rank is not None

    # -- measurement ----------------------------------------------------------------------
    def _peak(self) -> Peak:
        if self.cfg.peak_gflops > 0:
            return Peak(gflops_per_rank=self.cfg.peak_gflops,
                        source="given: --peak-gflops or $HPCAI_PEAK_GFLOPS")
        self.comm.Barrier()   # all ranks probe at once: the same contention as training
        mine, probe = self._gemm_probe()
        best = self.comm.allreduce(mine, op=MPI.MAX)
        return Peak(gflops_per_rank=round(best, 2),
                    source=f"measured: {probe}, best of 8, {self.threads} thread(s) per rank, "
                           "all ranks at once, maximum over ranks")

    # -- the loop -------------------------------------------------------------------------
    def fit(self) -> int:
        cfg, comm = self.cfg, self.comm
        if cfg.resume:
            own_statistics = self._resume()
        else:
            self._broadcast()
            own_statistics = False
        self._verify(exact=True, what="initial weights", buffers=not own_statistics)
        flops = self.task.flops_per_sample()
        peak = self._peak()
        prov = provenance(comm, comm_backend=self.comm_backend, threads=self.threads,
                          framework=self.framework,
                          framework_version=self._framework_version())
        if self.rank == 0:
            cfg.out_dir.mkdir(parents=True, exist_ok=True)
            if self.note:
                print(f"hpcai-train: {self.note}", flush=True)
            recipe = recipes.describe(cfg.recipe, cfg.overrides)
            print(f"hpcai-train: {cfg.model} ({self.framework}) on {self.world} rank(s) x "
                  f"{self.threads} thread(s), {recipe}batch {cfg.batch_size}/rank, "
                  f"lr {self.target_lr:g} ({cfg.lr_scaling} scaling of {cfg.lr:g}, decay "
                  f"{cfg.lr_decay}), {self.steps} steps/epoch, "
                  f"{flops / 1e9:.3f} GFLOP/sample, comm {self.comm_backend}"
                  f"{self.comm_detail}, "
                  f"{prov.mpi_library_version[:40]}, stall timeout {self.watch.describe()}",
                  flush=True)
            if self.validator is not None:
                print(f"hpcai-train: physics validation on {self.validator.describe()}: "
                      f"{cfg.out_dir / 'physics.json'}", flush=True)
        self.watch.start()
        for epoch in range(self.start_epoch, cfg.epochs):
            first_step = self.start_step if epoch == self.start_epoch else 0
            if self._epoch(epoch, first_step, flops, peak, prov):
                if self.rank == 0:
                    name = checkpoint.list_checkpoints(cfg.checkpoint_dir)[-1]
                    by = self.preemption.signal or "on another rank"
                    print(f"hpcai-train: preempted by signal {by}: checkpoint {name}; rerun "
                          "with --resume to continue", flush=True)
                self._catch_up_plots()
                self.watch.finish()
                return EXIT_PREEMPTED
        self.watch.finish()
        return 0

    def _epoch(self, epoch: int, first_step: int, flops: float, peak: Peak,
               prov: Provenance) -> bool:
        """Train one epoch from ``first_step``; True if it was preempted (checkpointed)."""
        cfg, comm = self.cfg, self.comm
        for r in self.reducers.values():
            r.stats.reset()
        verify_s = 0.0
        sums: dict[str, float] = {}
        steps_done = 0
        lr = self.target_lr
        preempted = False
        step_log = []
        start = time.perf_counter()
        stream = BatchStream(self.sharder, self.data, epoch, start_step=first_step,
                             prefetch=cfg.prefetch)
        watch = self.watch
        progress = Progress(epoch, self.steps) if self.rank == 0 else None
        try:
            watch.begin_step(self.global_step)
            for step, x, y in stream:
                if step >= self.steps:
                    break
                watch.enter("step")
                lr = self._set_lr(epoch, step)
                seed = step_seed(cfg.seed, self.rank, epoch, step)
                rng = self._step_rng(seed)
                losses = self.task.train_step(x, y, rng, self._synced)
                for key, value in losses.items():
                    sums[key] = sums.get(key, 0.0) + value
                steps_done += 1
                self.global_step += 1
                self._maybe_inject_fault()
                if progress is not None:
                    step_log.append({"epoch": epoch, "step": step, "lr": lr, **losses})
                    progress.step(step + 1)
                if cfg.verify_every and self.global_step % cfg.verify_every == 0:
                    watch.enter("replica check")
                    verify_s += self._verify(exact=False, what="weights")
                watch.enter("preemption check")
                t0 = time.perf_counter()
                stop = self.preemption.agreed(comm)
                verify_s += time.perf_counter() - t0
                watch.end_step()
                if stop or (cfg.checkpoint_every and self.global_step % cfg.checkpoint_every == 0):
                    self._save(epoch, step + 1, step_log)
                if stop:
                    preempted = True
                    break
                watch.begin_step(self.global_step)
        finally:
            stream.close()
            if progress is not None:
                progress.clear()
        if preempted:
            return True
        if not steps_done and first_step:   # resumed after the last step: its rate
            lr = self._set_lr(epoch, first_step - 1)
        watch.enter("epoch end")
        self._finish_device_work()
        self._flush_steps(step_log)
        if cfg.bn == "average":
            self._average_bn()
        verify_s += self._verify(exact=False, what="weights at epoch end",
                                 buffers=cfg.bn == "average")
        wall = time.perf_counter() - start
        grad_sync_s = self.comm_wait_s
        comm_s = grad_sync_s + verify_s
        data_s = stream.wait_s
        mean = lambda v: comm.allreduce(v, op=MPI.SUM) / self.world  # noqa: E731
        wall_max = comm.allreduce(wall, op=MPI.MAX)
        keys = sorted(sums)
        loss_means = {k: mean(v / max(steps_done, 1))
                      for k, v in zip(keys, self._to_host([sums[k] for k in keys]))}
        samples_rank = steps_done * cfg.batch_size
        gflops_rank = flops * samples_rank / wall_max / 1e9 if wall_max > 0 else 0.0
        stats = [r.stats for r in self.reducers.values()]
        compute_mean, comm_mean = mean(wall - comm_s - data_s), mean(comm_s)
        grad_sync_mean = mean(grad_sync_s)
        imbalance_mean = mean(sum(s.imbalance_s for s in stats))
        data_mean = mean(data_s)
        max_rss_mb = round(comm.allreduce(_max_rss_mb(), op=MPI.MAX), 1)
        physics_summary = physics_words = None
        if self.validator is not None and due(epoch, cfg.epochs, cfg.validate_every):
            watch.enter("physics validation")   # collective: every rank its share
            validations = self.validator.run(self.task, epoch)
            if validations is not None:   # rank 0
                doc = record_physics(cfg.out_dir, validations, self.validator.held_out,
                                     draw=False)
                if self.plots.due(last=epoch == cfg.epochs - 1):
                    self._draw_plots(f"after epoch {epoch}", doc)
                physics_summary = validations[0].summary()
                physics_words = worst_bin(validations[0])
        watch.enter("evaluation and records")   # the collectives are done: rank 0 alone
        evaluated = self._evaluate() if self.rank == 0 and cfg.eval_samples > 0 else None
        record = EpochRecord(
            model=cfg.model, framework=self.framework, epoch=epoch,
            steps=steps_done, first_step=first_step,
            epoch_time_s=round(wall_max, 4),
            compute_s=round(compute_mean, 4),
            comm_s=round(comm_mean, 4),
            grad_sync_s=round(grad_sync_mean, 4),
            grad_sync_imbalance_s=round(imbalance_mean, 4),
            data_s=round(data_mean, 4),
            samples_per_rank=samples_rank,
            samples_per_s_per_rank=round(samples_rank / wall_max, 3),
            samples_per_s=round(samples_rank * self.world / wall_max, 3),
            flops_per_sample=flops,
            flop_convention=self.task.flop_convention + (
                " (3DGAN: D real + D fake + 2 x G per real sample)"
                if cfg.model == "3dgan" else ""),
            gflops_per_rank=round(gflops_rank, 3),
            gflops_total=round(gflops_rank * self.world, 3),
            peak=peak,
            pct_of_peak=round(100 * gflops_rank / peak.gflops_per_rank, 2),
            lr=lr, losses=loss_means,
            allreduce=AllreduceTotals(bytes_per_rank=sum(s.bytes for s in stats),
                                      calls=sum(s.allreduces for s in stats),
                                      overlap=cfg.overlap, bucket_mb=cfg.bucket_mb),
            max_rss_mb_per_rank=max_rss_mb,
            provenance=prov,
            eval=evaluated,
            physics=physics_summary,
            precision=cfg.precision,
            memory_format=cfg.memory_format,
        )
        if self.rank == 0:
            with open(cfg.out_dir / "epochs.jsonl", "a", encoding="utf-8") as handle:
                handle.write(record.to_json() + "\n")
            print(epoch_line(record, self.task.loss_keys, physics_words,
                             "avg" if cfg.generator_ema else None), flush=True)
        self._save(epoch + 1, 0, step_log)
        return False

    def _evaluate(self) -> dict[str, float]:
        """Rank 0: the task's metrics on a fixed sample, the last ``eval_samples`` events of
        the data set (the same every epoch, and also seen in training - a progress gauge, not
        a test score). For the 3DGAN: aux energy error and Σcells / f(E') of generated
        showers."""
        count = min(self.cfg.eval_samples, len(self.data))
        x, y = self.data.read(list(range(len(self.data) - count, len(self.data))))
        metrics = self.task.evaluate(x, y)
        return {"samples": count, **{k: round(v, 5) for k, v in metrics.items()}}

    def _catch_up_plots(self) -> None:
        """Rank 0, when a preemption stops the run: draw the validations the plots lack."""
        if self.rank == 0 and self.plots.behind:
            self.watch.enter("physics plots")
            if self._draw_plots("at the stop"):
                print(f"hpcai-train: physics plots drawn at the stop: {self.cfg.out_dir}",
                      flush=True)

    def _draw_plots(self, when: str, doc: dict | None = None) -> bool:
        """Rank 0: draw the plots of physics.json (``doc``, the document just written, or
        else read from the file). A drawing that fails (a file that cannot be written, say)
        is reported and training goes on: physics.json and the checkpoints hold everything,
        ``hpcai-launch report`` redraws the plots, and the next due drawing tries again."""
        try:
            if doc is None:
                redraw(self.cfg.out_dir)
            else:
                write_plots(doc, self.cfg.out_dir)
        except Exception as exc:   # noqa: BLE001 - the plots are a view; say, go on
            print(f"hpcai-train: warning: the physics plots could not be drawn {when} "
                  f"({type(exc).__name__}: {exc}); hpcai-launch report {self.cfg.out_dir} "
                  "draws them", flush=True)
            return False
        self.plots.drawn()
        return True

    def _maybe_inject_fault(self) -> None:
        """``HPCAI_INJECT_FAULT=RANK:STEP`` raises on that rank after that global step, so
        sites and tests can watch the whole job abort with the root cause named."""
        spec = os.environ.get("HPCAI_INJECT_FAULT", "")
        rank, _, step = spec.partition(":")
        if rank.isdigit() and step.isdigit() and (int(rank), int(step)) == (
                self.rank, self.global_step):
            raise RuntimeError(f"injected fault (HPCAI_INJECT_FAULT={spec})")

    def _flush_steps(self, step_log: list) -> None:
        if self.rank == 0 and step_log:
            keys = [[k for k in entry if k not in _STEP_KEYS] for entry in step_log]
            values = iter(self._to_host([entry[k] for entry, ks in zip(step_log, keys)
                                         for k in ks]))
            with open(self.cfg.out_dir / "steps.jsonl", "a", encoding="utf-8") as handle:
                for entry, ks in zip(step_log, keys):
                    entry = {**entry, **{k: next(values) for k in ks}}
                    handle.write(json.dumps(entry) + "\n")
            step_log.clear()
