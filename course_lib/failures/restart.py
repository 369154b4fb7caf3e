"""Restart after a dead rank: a data-parallel training run that ``torchrun --max-restarts=N`` can restart after one of
its ranks is killed, and that then goes on **bit for bit** as if nothing had happened.

When one rank of a collective job dies (a GPU falls off the bus, a host is lost, a kernel OOMs), the others block
in their next collective; torchrun's elastic agent sees the dead worker, stops the survivors and starts the whole
group again (``--max-restarts`` times). Everything the processes held in memory is gone: the run continues only
from what a checkpoint wrote. For the continuation to equal the uninterrupted run, the checkpoint must hold every
piece of state that decides the next steps:

* the weights, and the optimizer's state (AdamW's m, v and step count): without them the update differs;
* the learning-rate scheduler's position (its step count): without it the schedule restarts at warm-up;
* the sampler's position in the epoch (``ResumableSampler``): without it the run repeats the epoch's first
  batches and skips others;
* every rank's random-number generator (here dropout draws from it): without it the masks differ.

``capture_state`` / ``restore_state`` are those pieces as one picklable dict per rank. ``save_checkpoint`` writes
them atomically (each rank its own file into ``step<k>.tmp``, then rank 0 renames the folder once every rank has
written, so a kill during a save leaves the previous checkpoint intact) and ``latest_checkpoint`` finds the last
complete one. ``python -m course_lib.failures.restart`` is the training script torchrun runs: it resumes from the latest
checkpoint, can SIGKILL one rank mid-step on its first attempt (``--kill-rank``, ``--kill-step``), and writes each
step's loss and the final weights. ``run_torchrun`` starts it with ``python -m torch.distributed.run --standalone``
(the c10d rendezvous on 127.0.0.1) and returns what it wrote. The same idea at scale: torchtitan's checkpointer and
``torch.distributed.checkpoint`` with a ``Stateful`` data loader (``torchdata``'s ``StatefulDataLoader``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.data import corpus_tokens
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig

PIECES = ("model", "optimizer", "scheduler", "sampler", "rng")
"""What a bit-exact restart needs from the checkpoint (``capture_state``'s keys)."""
RESTART_CONFIG = GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16, bias=False)
"""The tiny model the restart script trains (a few ms a step on a laptop core)."""


class DropoutGPT(GPT):
    """The course's GPT with dropout ``p`` on the embeddings, drawn from the global RNG (so the RNG is part of the
    training state, as in any real run with dropout)."""

    def __init__(self, config: GPTConfig, seed: int = 0, p: float = 0.1) -> None:
        super().__init__(config, seed)
        self.p = p

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = F.dropout(self.embed(idx), self.p, self.training)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@dataclass
class ResumableSampler:
    """Rank ``rank``'s batches of ``batch`` window indices out of ``n``, one epoch after another, each epoch in a
    fresh order drawn from (``seed``, epoch) and dealt round-robin over ``world_size`` ranks (as
    ``torch.utils.data.DistributedSampler``); ``state_dict`` is its position (epoch, batches drawn in it)."""

    n: int
    batch: int
    rank: int
    world_size: int
    seed: int = 0
    epoch: int = 0
    offset: int = 0

    def __post_init__(self) -> None:
        if self.batch < 1 or self.batches_per_epoch < 1:
            raise ValueError(f"rank {self.rank}: {self.n} windows cannot give {self.world_size} ranks a batch of "
                             f"{self.batch} each: use a smaller batch or fewer ranks")

    @property
    def batches_per_epoch(self) -> int:
        return self.n // (self.world_size * self.batch)

    def __next__(self) -> list[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 7919 + self.epoch))
        mine = order[self.rank::self.world_size]
        out = mine[self.offset * self.batch:(self.offset + 1) * self.batch].tolist()
        self.offset += 1
        if self.offset == self.batches_per_epoch:
            self.epoch, self.offset = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]


def windows(seq_len: int, stride: int | None = None) -> torch.Tensor:
    """The dataset: start positions of fixed windows of ``seq_len + 1`` tokens over the shipped corpus."""
    return torch.arange(0, corpus_tokens().numel() - seq_len - 1, stride or seq_len)


def batch_of(indices: Sequence[int], starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets [len(indices), seq_len] of the windows ``indices``."""
    tokens = corpus_tokens()
    rows = torch.stack([tokens[s:s + seq_len + 1] for s in starts[list(indices)].tolist()])
    return rows[:, :-1], rows[:, 1:]


def capture_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, sampler: ResumableSampler,
                  skip: Iterable[str] = ()) -> dict[str, Any]:
    """This rank's training state, every piece of ``PIECES`` except those in ``skip`` (``skip`` exists to show what
    a restart without a piece does)."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "sampler": sampler.state_dict(), "rng": torch.get_rng_state()}
    return {k: v for k, v in state.items() if k not in set(skip)}


def restore_state(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                  sampler: ResumableSampler) -> None:
    """Put every piece ``state`` holds back into the live objects (a missing piece keeps its fresh value)."""
    if "model" in state:
        model.load_state_dict(state["model"])
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    if "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    if "sampler" in state:
        sampler.load_state_dict(state["sampler"])
    if "rng" in state:
        torch.set_rng_state(state["rng"])


def save_checkpoint(folder: Path, step: int, state: dict[str, Any]) -> Path:
    """Every rank writes ``state`` to ``folder/step<step>.tmp/rank<r>.pt``; once all have, rank 0 renames the folder
    to ``step<step>`` (atomic on one file system): a kill mid-save leaves only a ``.tmp`` that nobody reads."""
    rank = dist.get_rank()
    tmp, final = folder / f"step{step:06d}.tmp", folder / f"step{step:06d}"
    tmp.mkdir(parents=True, exist_ok=True)
    torch.save(state, tmp / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        os.replace(tmp, final)
    dist.barrier()
    return final


def latest_checkpoint(folder: Path) -> tuple[int, Path] | None:
    """(steps done, folder) of the last complete checkpoint under ``folder``, or None."""
    done = sorted(p for p in folder.glob("step*") if p.is_dir() and not p.name.endswith(".tmp"))
    return (int(done[-1].name[4:]), done[-1]) if done else None


@dataclass(frozen=True)
class RunSettings:
    """One restartable run: ``steps`` optimizer steps of ``batch`` rows per rank, a checkpoint every ``every``
    steps, AdamW at ``lr`` warmed up linearly over ``warmup`` steps; ``skip``: pieces left out of the checkpoint."""

    steps: int = 8
    batch: int = 4
    every: int = 2
    lr: float = 3e-3
    warmup: int = 8
    skip: tuple[str, ...] = ()


def build(settings: RunSettings, rank: int, world_size: int) -> tuple[nn.Module, torch.optim.Optimizer, Any,
                                                                      ResumableSampler, torch.Tensor]:
    """A fresh model, optimizer, scheduler, sampler and the dataset's window starts; the global RNG seeded by rank
    (every rank draws its own dropout masks)."""
    torch.manual_seed(1000 + rank)
    model = DropoutGPT(RESTART_CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=settings.warmup)
    starts = windows(RESTART_CONFIG.seq_len)
    return model, optimizer, scheduler, ResumableSampler(len(starts), settings.batch, rank, world_size), starts


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, x: torch.Tensor,
               y: torch.Tensor) -> float:
    """One data-parallel step: local loss, backward, gradients averaged by all-reduce, AdamW, scheduler; the
    global mean loss (all-reduced) is returned."""
    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    loss.backward()
    world_size = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
    optimizer.step()
    scheduler.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return (mean / world_size).item()


def train_resumable(rank: int, world_size: int, out: Path, settings: RunSettings, attempt: int = 0,
                    kill_rank: int | None = None, kill_step: int | None = None) -> None:
    """The per-rank body of the restart script (any launcher: torchrun, ``course_lib.runtime.launch``): resume from the
    latest checkpoint in ``out``, train to ``settings.steps``, append ``{"attempt", "step", "loss"}`` lines to
    ``out/losses.jsonl`` (rank 0) and write the final weights to ``out/final.pt``. On attempt 0, rank
    ``kill_rank`` SIGKILLs itself in the middle of step ``kill_step`` (its batch drawn, before its forward: the
    other ranks block in the all-reduce). One thread a rank, so that any two launchers compute the same bits."""
    torch.set_num_threads(1)
    model, optimizer, scheduler, sampler, starts = build(settings, rank, world_size)
    found = latest_checkpoint(out / "checkpoints")
    done = 0
    if found:
        done, folder = found
        restore_state(torch.load(folder / f"rank{rank}.pt", weights_only=False), model, optimizer, scheduler,
                      sampler)
    for step in range(done, settings.steps):
        x, y = batch_of(next(sampler), starts, RESTART_CONFIG.seq_len)
        if attempt == 0 and rank == kill_rank and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = train_step(model, optimizer, scheduler, x, y)
        if rank == 0:
            with open(out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"attempt": attempt, "step": step, "loss": loss}) + "\n")
        if (step + 1) % settings.every == 0:
            save_checkpoint(out / "checkpoints", step + 1,
                            capture_state(model, optimizer, scheduler, sampler, settings.skip))
    if rank == 0:
        torch.save(model.state_dict(), out / "final.pt")


def _init_group(attempt: int) -> None:
    """The default process group under torchrun, its store keys kept apart per attempt (``PrefixStore``): a
    restarted group must not read the addresses the previous attempt's ranks published."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


@dataclass
class RestartResult:
    """What a torchrun job wrote: the per-step losses of every attempt, the final weights, and how many times the
    group was started."""

    losses: list[dict[str, Any]]
    final: dict[str, torch.Tensor]
    attempts: int
    log: str

    def curve(self) -> dict[int, float]:
        """Step -> loss as the run finally computed it (a replayed step's last attempt wins)."""
        return {r["step"]: r["loss"] for r in self.losses}


def run_torchrun(out: Path, settings: RunSettings, nproc: int = 2, max_restarts: int = 1,
                 kill_rank: int | None = None, kill_step: int | None = None, timeout: float = 240.0) -> RestartResult:
    """Run the restart script under ``python -m torch.distributed.run --standalone --nproc-per-node=nproc
    --max-restarts=max_restarts`` with its output in folder ``out`` (created empty); raise with torchrun's log if it
    failed or ran past ``timeout`` seconds (its whole process group is killed then)."""
    if kill_rank is not None and not 0 <= kill_rank < nproc:
        raise ValueError(f"kill_rank={kill_rank} is not a rank of a {nproc}-rank job: choose 0..{nproc - 1}")
    if (kill_rank is None) != (kill_step is None) or (kill_step is not None and not 0 <= kill_step < settings.steps):
        raise ValueError(f"kill_rank={kill_rank}, kill_step={kill_step}: give both (or neither), with kill_step one "
                         f"of the run's steps 0..{settings.steps - 1}")
    out.mkdir(parents=True, exist_ok=False)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
           "-m", "course_lib.failures.restart", "--out", str(out),
           "--steps", str(settings.steps), "--batch", str(settings.batch), "--every", str(settings.every),
           "--lr", str(settings.lr), "--warmup", str(settings.warmup), "--skip", ",".join(settings.skip)]
    if kill_rank is not None:
        cmd += ["--kill-rank", str(kill_rank), "--kill-step", str(kill_step)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise TimeoutError(f"torchrun ran past {timeout} s and was killed; its log:\n{log[-4000:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with {proc.returncode} (a rank failed more than --max-restarts="
                           f"{max_restarts} times?); its log:\n{log[-4000:]}")
    return read_result(out, log)


def read_result(out: Path, log: str = "") -> RestartResult:
    """What the run in folder ``out`` wrote (its losses and final weights)."""
    lines = [json.loads(s) for s in (out / "losses.jsonl").read_text().splitlines()]
    return RestartResult(lines, torch.load(out / "final.pt", weights_only=True),
                         1 + max((r["attempt"] for r in lines), default=0), log)


def run_launched(out: Path, settings: RunSettings, nproc: int = 2, stop_at: int | None = None) -> RestartResult:
    """The same run on ``nproc`` ranks of ``course_lib.runtime.launch`` (no torchrun): uninterrupted, or, with
    ``stop_at``, stopped after its checkpoint at step ``stop_at`` and resumed by a second launch (attempt 1) -- a
    restart with nothing killed, quick enough to try every piece left out."""
    from course_lib.runtime.launch import launch  # the launcher is not needed by the torchrun script itself

    if stop_at is not None and (stop_at % settings.every or not 0 < stop_at < settings.steps):
        raise ValueError(f"stop_at={stop_at} must be a checkpoint step (a multiple of every={settings.every}) "
                         f"inside the run's {settings.steps} steps")
    out.mkdir(parents=True, exist_ok=False)
    if stop_at is not None:
        launch(train_resumable, nproc, out, replace(settings, steps=stop_at))
    launch(train_resumable, nproc, out, settings, 0 if stop_at is None else 1)
    return read_result(out)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="A restartable data-parallel run (start it with torchrun).")
    p.add_argument("--out", type=Path, required=True)
    for name, default in (("steps", 8), ("batch", 4), ("every", 2), ("warmup", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--skip", default="", help=f"comma-separated pieces to leave out of the checkpoint: {PIECES}")
    p.add_argument("--kill-rank", type=int)
    p.add_argument("--kill-step", type=int)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    a = _parse(argv)
    skip = tuple(s for s in a.skip.split(",") if s)
    unknown = set(skip) - set(PIECES)
    if unknown:
        raise SystemExit(f"--skip {sorted(unknown)}: not a piece of the checkpoint; choose from {PIECES}")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _init_group(attempt)
    try:
        train_resumable(dist.get_rank(), dist.get_world_size(), a.out,
                        RunSettings(a.steps, a.batch, a.every, a.lr, a.warmup, skip), attempt, a.kill_rank, a.kill_step)
        dist.barrier()  # leave together: rank 0 still writes final.pt after the last collective
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # A finished rank skips the interpreter's teardown, as course_lib.runtime's ranks do: with gloo's threads about,
    # it can abort the process ("terminate called without an active exception"; 6 runs in 213 on 2 busy cores),
    # and torchrun would count a finished rank as failed and restart the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
