"""The trainer: one object per rank that runs the epochs (imported once MPI may start).

Per step: this rank's shard of a seed-shuffled epoch order, the model's step with gradients
averaged by the fused, overlapped allreduce, a cheap replica check every K steps, a
collective look at the preemption flag. Per epoch: BatchNorm statistics handled as asked,
replicas verified, one JSON record (time split, samples/s, FLOP rate, % of peak,
provenance) and an atomic checkpoint.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

import torch
from mpi4py import MPI

from ..core.errors import UserError

from . import checkpoint
from .allreduce import GradAllreducer, HorovodTransport, MpiTransport, TorchDistTransport
from .config import TrainConfig
from .faults import EXIT_PREEMPTED, Preemption
from .gan_data import BatchStream, EpochSharder, ShowerReader, SyntheticImages, find_files, validate
from .metrics import gemm_peak_gflops, provenance
from .replicas import broadcast_state, verify
from .showers import generate
from .tasks import make_task

RECORD_VERSION = 1


def _max_rss_mb() -> float:
    """This process's peak resident set size so far (MiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step_seed(seed: int, rank: int, epoch: int, step: int) -> int:
    """Per-rank, per-step RNG seed: a resumed run draws the very same noise."""
    return zlib.crc32(f"{seed}:{rank}:{epoch}:{step}".encode())


class Trainer:
    def __init__(self, cfg: TrainConfig, comm, index) -> None:
        self.cfg, self.comm = cfg, comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.threads = self._threads()
        self.data, self.sharder = self._data(index)
        self.base_lr = cfg.lr
        self.target_lr = cfg.lr * (self.world if cfg.lr_scaling == "linear" else 1)
        self.task = self._make_task()
        self.transport, self.reducers = self._comm()
        self.preemption = Preemption().install()
        self.global_step = 0
        self.start_epoch, self.start_step = 0, 0
        self.steps = (min(self.sharder.steps_per_epoch, cfg.max_steps) if cfg.max_steps
                      else self.sharder.steps_per_epoch)
        if self.steps < 1:
            raise UserError(
                f"{len(self.data)} samples are too few for one step of {cfg.batch_size} x "
                f"{self.world} ranks", "generate more data or lower --batch-size")

    # -- framework hooks (PyTorch here; tf_trainer.TfTrainer overrides them) ---------------
    framework = "pytorch"

    def _threads(self) -> int:
        return torch.get_num_threads()

    def _make_task(self):
        return make_task(self.cfg, self.target_lr)

    def _broadcast(self) -> None:
        broadcast_state(list(self.task.modules.values()), self.comm)

    def _apply_lr(self, lr: float) -> None:
        for opt in self.task.optimizers.values():
            for group in opt.param_groups:
                group["lr"] = lr

    def _task_state(self) -> dict:
        return {"modules": {k: m.state_dict() for k, m in self.task.modules.items()},
                "optimizers": {k: o.state_dict() for k, o in self.task.optimizers.items()}}

    def _load_task_state(self, state: dict) -> None:
        for key, module in self.task.modules.items():
            module.load_state_dict(state["modules"][key])
        for key, opt in self.task.optimizers.items():
            opt.load_state_dict(state["optimizers"][key])

    def _step_rng(self, seed: int):
        torch.manual_seed(seed)   # dropout draws from the global generator
        return torch.Generator().manual_seed(seed)

    def _gemm_probe(self) -> tuple[float, str]:
        return gemm_peak_gflops(), "fp32 GEMM 2048^3 (torch.mm)"

    def _versions(self) -> dict:
        return {"framework": self.framework, "framework_version": torch.__version__}

    # -- set-up ---------------------------------------------------------------------------
    def _data(self, index):
        cfg = self.cfg
        if cfg.model == "3dgan":
            if index is None:
                index = self._generate()
            data = ShowerReader(index)
        else:
            data = SyntheticImages(cfg.samples, cfg.image_size, cfg.classes, seed=cfg.seed)
        sharder = EpochSharder(len(data), self.world, self.rank, cfg.batch_size, cfg.seed)
        return data, sharder

    def _generate(self):
        target = self.cfg.out_dir / "data"
        per_file = min(self.cfg.generate_events, 1000)
        n_files = -(-self.cfg.generate_events // per_file)
        if self.rank == 0:
            existing = find_files(target) if target.is_dir() and any(target.glob("*.h5")) else []
            if len(existing) != n_files:
                generate(target, n_files=n_files, events_per_file=per_file, seed=self.cfg.seed)
        self.comm.Barrier()
        return validate(find_files(target))

    def _comm(self):
        cfg = self.cfg
        if cfg.comm == "gloo":
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo", init_method="env://", rank=self.rank,
                                        world_size=self.world)
            transport = TorchDistTransport("gloo")
        elif cfg.comm == "horovod":
            transport = HorovodTransport(self.comm)
        else:
            transport = MpiTransport(self.comm)
        reducers = {id(m): GradAllreducer(m, transport, bucket_mb=cfg.bucket_mb,
                                          overlap=cfg.overlap)
                    for m in self.task.modules.values()}
        return transport, reducers

    def _after_backward(self, module) -> None:
        self.reducers[id(module)].synchronize()

    @property
    def comm_wait_s(self) -> float:
        return sum(r.stats.wait_s for r in self.reducers.values())

    # -- replicas, lr, checkpoints --------------------------------------------------------
    def _verify(self, exact: bool, what: str, buffers: bool = False) -> float:
        start = time.perf_counter()
        verify(list(self.task.modules.values()), self.comm, exact=exact, what=what,
               buffers=buffers)
        return time.perf_counter() - start

    def _set_lr(self, epoch: int, step: int) -> float:
        cfg = self.cfg
        lr = self.target_lr
        warm_steps = cfg.warmup_epochs * self.steps
        done = epoch * self.steps + step
        if warm_steps > 0 and done < warm_steps:
            lr = self.base_lr + (self.target_lr - self.base_lr) * done / warm_steps
        self._apply_lr(lr)
        return lr

    def _state(self, epoch: int, step: int) -> dict:
        return {
            "version": RECORD_VERSION,
            "model": self.cfg.model, "framework": self.framework,
            "epoch": epoch, "step": step, "global_step": self.global_step,
            "world_size": self.world, "batch_size": self.cfg.batch_size,
            "steps_per_epoch": self.steps, "config": self.cfg.to_dict(),
            **self._task_state(),
        }

    def _save(self, epoch: int, step: int) -> Path | None:
        path = None
        if self.rank == 0:
            path = checkpoint.save(self.cfg.checkpoint_dir, self._state(epoch, step), epoch,
                                   step, keep=self.cfg.keep)
        self.comm.Barrier()
        return path

    def _resume(self) -> None:
        found = checkpoint.load_latest(self.cfg.checkpoint_dir)
        if found is None:
            if self.rank == 0:
                print(f"hpcai-train: no checkpoint in {self.cfg.checkpoint_dir}; "
                      "starting from scratch", flush=True)
            return
        path, state = found
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
        self.start_epoch, self.start_step = state["epoch"], state["step"]
        self.global_step = state["global_step"]
        if self.start_step >= self.steps:
            self.start_epoch, self.start_step = self.start_epoch + 1, 0
        if self.rank == 0:
            print(f"hpcai-train: resumed from {path} at epoch {self.start_epoch} step "
                  f"{self.start_step}", flush=True)

    # -- measurement ----------------------------------------------------------------------
    def _peak(self) -> dict:
        if self.cfg.peak_gflops > 0:
            return {"gflops_per_rank": self.cfg.peak_gflops, "source": "--peak-gflops"}
        self.comm.Barrier()   # all ranks probe at once: the same contention as training
        mine, probe = self._gemm_probe()
        best = self.comm.allreduce(mine, op=MPI.MAX)
        return {"gflops_per_rank": round(best, 2),
                "source": f"measured: {probe}, best of 8, {self.threads} thread(s) "
                          "per rank, all ranks at once, maximum over ranks"}

    # -- the loop -------------------------------------------------------------------------
    def fit(self) -> int:
        cfg, comm = self.cfg, self.comm
        if cfg.resume:
            self._resume()
        else:
            self._broadcast()
        self._verify(exact=True, what="initial weights")
        flops = self.task.flops_per_sample()
        peak = self._peak()
        prov = provenance(comm, comm_backend=cfg.comm, threads=self.threads,
                          **self._versions())
        out = cfg.out_dir
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            print(f"hpcai-train: {cfg.model} ({self.framework}) on {self.world} rank(s) x "
                  f"{self.threads} thread(s), batch {cfg.batch_size}/rank, lr {self.target_lr:g} "
                  f"({cfg.lr_scaling} scaling of {cfg.lr:g}), {self.steps} steps/epoch, "
                  f"{flops / 1e9:.3f} GFLOP/sample, comm {cfg.comm}, "
                  f"{prov['mpi_library_version'][:40]}", flush=True)
        for epoch in range(self.start_epoch, cfg.epochs):
            first_step = self.start_step if epoch == self.start_epoch else 0
            record, preempted = self._epoch(epoch, first_step, flops, peak, prov,
                                            self.task.flop_convention)
            if preempted:
                if self.rank == 0:
                    name = checkpoint.list_checkpoints(cfg.checkpoint_dir)[-1]
                    print(f"hpcai-train: preempted by signal {self.preemption.signal or 'on another rank'}: "
                          f"checkpoint {name}; rerun with --resume to continue", flush=True)
                return EXIT_PREEMPTED
        return 0

    def _epoch(self, epoch: int, first_step: int, flops: float, peak: dict, prov: dict,
               convention: str) -> tuple[dict | None, bool]:
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
        try:
            for step, x, y in stream:
                if step >= self.steps:
                    break
                lr = self._set_lr(epoch, step)
                seed = step_seed(cfg.seed, self.rank, epoch, step)
                rng = self._step_rng(seed)
                losses = self.task.train_step(x, y, rng, self._after_backward)
                for key, value in losses.items():
                    sums[key] = sums.get(key, 0.0) + value
                steps_done += 1
                self.global_step += 1
                self._maybe_inject_fault()
                if self.rank == 0:
                    step_log.append({"epoch": epoch, "step": step, **losses})
                if cfg.verify_every and self.global_step % cfg.verify_every == 0:
                    verify_s += self._verify(exact=False, what="weights")
                t0 = time.perf_counter()
                stop = self.preemption.agreed(comm)
                verify_s += time.perf_counter() - t0
                if stop or (cfg.checkpoint_every and self.global_step % cfg.checkpoint_every == 0):
                    self._flush_steps(step_log)
                    self._save(epoch, step + 1)
                if stop:
                    preempted = True
                    break
        finally:
            stream.close()
        self._flush_steps(step_log)
        if preempted:
            return None, True
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
        loss_means = {k: mean(v / max(steps_done, 1)) for k, v in sorted(sums.items())}
        samples_rank = steps_done * cfg.batch_size
        gflops_rank = flops * samples_rank / wall_max / 1e9 if wall_max > 0 else 0.0
        record = {
            "record": "epoch", "version": RECORD_VERSION, "model": cfg.model,
            "framework": self.framework, "epoch": epoch,
            "steps": steps_done, "first_step": first_step,
            "epoch_time_s": round(wall_max, 4),
            "compute_s": round(mean(wall - comm_s - data_s), 4),
            "comm_s": round(mean(comm_s), 4),
            "grad_sync_s": round(mean(grad_sync_s), 4),
            "grad_sync_imbalance_s": round(mean(sum(
                r.stats.imbalance_s for r in self.reducers.values())), 4),
            "data_s": round(mean(data_s), 4),
            "samples_per_rank": samples_rank,
            "samples_per_s_per_rank": round(samples_rank / wall_max, 3),
            "samples_per_s": round(samples_rank * self.world / wall_max, 3),
            "flops_per_sample": flops,
            "flop_convention": convention + (" (3DGAN: D real + D fake + 2 x G per real sample)"
                                             if cfg.model == "3dgan" else ""),
            "gflops_per_rank": round(gflops_rank, 3),
            "gflops_total": round(gflops_rank * self.world, 3),
            "peak": peak,
            "pct_of_peak": round(100 * gflops_rank / peak["gflops_per_rank"], 2),
            "lr": lr, "losses": loss_means,
            "allreduce": {"bytes_per_rank": sum(r.stats.bytes for r in self.reducers.values()),
                          "calls": sum(r.stats.allreduces for r in self.reducers.values()),
                          "overlap": cfg.overlap, "bucket_mb": cfg.bucket_mb},
            "max_rss_mb_per_rank": round(comm.allreduce(_max_rss_mb(), op=MPI.MAX), 1),
            "provenance": prov,
        }
        if self.rank == 0 and cfg.eval_samples > 0:
            record["eval"] = self._evaluate()
        if self.rank == 0:
            with open(cfg.out_dir / "epochs.jsonl", "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
            main_losses = " ".join(f"{k} {v:.4g}" for k, v in loss_means.items()
                                   if k in self.task.loss_keys)
            evaluated = " ".join(f"{k} {v:.4g}" for k, v in record.get("eval", {}).items()
                                 if k != "samples")
            if evaluated:
                main_losses += f" | on {record['eval']['samples']} fixed samples: {evaluated}"
            print(f"epoch {epoch}: {wall_max:.2f} s (compute {record['compute_s']:.2f}, comm "
                  f"{record['comm_s']:.2f}, data {record['data_s']:.2f}), "
                  f"{record['samples_per_s']:.2f} samples/s, {record['gflops_total']:.1f} "
                  f"GFLOP/s = {record['pct_of_peak']:.1f}% of peak "
                  f"{peak['gflops_per_rank']:.1f}/rank | {main_losses}", flush=True)
        self._save(epoch + 1, 0)
        return record, False

    def _evaluate(self) -> dict:
        """Rank 0: the task's metrics on a fixed sample, the last ``eval_samples`` events of
        the data set (the same every epoch, and also seen in training - a progress gauge, not
        a test score). For the 3DGAN: aux energy error and Σcells / f(E') of generated
        showers."""
        count = min(self.cfg.eval_samples, len(self.data))
        x, y = self.data.read(list(range(len(self.data) - count, len(self.data))))
        metrics = self.task.evaluate(x, y)
        return {"samples": count, **{k: round(v, 5) for k, v in metrics.items()}}

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
            with open(self.cfg.out_dir / "steps.jsonl", "a", encoding="utf-8") as handle:
                for entry in step_log:
                    handle.write(json.dumps(entry) + "\n")
            step_log.clear()

    def _average_bn(self) -> None:
        for module in self.task.modules.values():
            for m in module.modules():
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                    for buf in (m.running_mean, m.running_var):
                        self.comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)
                        buf.div_(self.world)
