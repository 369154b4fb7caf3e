"""Wrong answers for chapter 10 (failures at scale)."""

import torch

from course_lib.failures.restart import batch_of, build, train_step


def capture_state(model, optimizer, scheduler, sampler):
    """A learner's own capture (the library's is not allowed in the exercise): every piece of this rank."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(), "rng": torch.get_rng_state()}


def restore_state(state, model, optimizer, scheduler, sampler):
    """A learner's own restore: every piece ``state`` holds back into the live objects."""
    for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler), ("sampler", sampler)):
        if name in state:
            obj.load_state_dict(state[name])
    if "rng" in state:
        torch.set_rng_state(state["rng"])


def checkpoint_rank0_rng_for_all(mode, rank, folder, model, optimizer, scheduler, sampler):
    """Rank 0 writes everything, its own generator and sampler included, and every rank restores rank 0's."""
    path = folder / "all.pt"
    if mode == "save":
        if rank == 0:
            torch.save(capture_state(model, optimizer, scheduler, sampler), path)
        return
    restore_state(torch.load(path, weights_only=False), model, optimizer, scheduler, sampler)


def checkpoint_everything_on_every_rank(mode, rank, folder, model, optimizer, scheduler, sampler):
    """Correct resume, but every rank writes the weights and the optimizer state: N copies on disk."""
    path = folder / f"rank{rank}.pt"
    if mode == "save":
        torch.save(capture_state(model, optimizer, scheduler, sampler), path)
        return
    restore_state(torch.load(path, weights_only=False), model, optimizer, scheduler, sampler)


def checkpoint_without_scheduler(mode, rank, folder, model, optimizer, scheduler, sampler):
    """The scheduler is left out (the optimizer's lr hides it for one step)."""
    shared, mine = folder / "shared.pt", folder / f"rank{rank}.pt"
    if mode == "save":
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, shared)
        torch.save({"sampler": sampler.state_dict(), "rng": torch.get_rng_state()}, mine)
        return
    restore_state(torch.load(shared, weights_only=False) | torch.load(mine, weights_only=False), model, optimizer,
                  scheduler, sampler)


def _checkpoint(mode, rank, folder, model, optimizer, scheduler, sampler, *,
                on_rank0=("model", "optimizer", "scheduler"), on_rank1=(), everyone=(), twice=(), pickled=False):
    """Rank 0 writes the pieces of ``on_rank0`` (those of ``twice`` into a second file too), rank 1 those of
    ``on_rank1``, every rank those of ``everyone`` and its sampler and generator; with torch.save, or pickle."""
    import pickle

    def write(obj, path):
        if not pickled:
            return torch.save(obj, path)
        with open(path, "wb") as f:
            pickle.dump(obj, f)

    def read(path):
        if not pickled:
            return torch.load(path, weights_only=False)
        with open(path, "rb") as f:
            return pickle.load(f)

    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    mine = folder / f"rank{rank}.pt"
    if mode == "save":
        for r, pieces in ((0, on_rank0), (1, on_rank1)):
            if rank == r and pieces:
                write({k: state[k] for k in pieces}, folder / f"shared{r}.pt")
        if rank == 0 and twice:
            write({k: state[k] for k in twice}, folder / "latest.pt")
        write({k: state[k] for k in everyone} | {"sampler": sampler.state_dict(), "rng": torch.get_rng_state()}, mine)
        return
    common = {}
    for r in (0, 1):
        if (folder / f"shared{r}.pt").exists():
            common |= read(folder / f"shared{r}.pt")
    restore_state(common | read(mine), model, optimizer, scheduler, sampler)


def checkpoint_weights_on_every_rank(mode, rank, folder, model, optimizer, scheduler, sampler):
    """Every rank writes the weights (each its own copy, so each can load its own); the optimizer's state once:
    16 bytes a parameter on 2 ranks, under the size bound, but the weights are written twice."""
    return _checkpoint(mode, rank, folder, model, optimizer, scheduler, sampler, everyone=("model",),
                       on_rank0=("optimizer", "scheduler"))


def checkpoint_scheduler_on_every_rank(mode, rank, folder, model, optimizer, scheduler, sampler):
    """The scheduler's state written by every rank with its own pieces (it is tiny; it is the same everywhere)."""
    return _checkpoint(mode, rank, folder, model, optimizer, scheduler, sampler, everyone=("scheduler",),
                       on_rank0=("model", "optimizer"))


def checkpoint_weights_twice(mode, rank, folder, model, optimizer, scheduler, sampler):
    """Rank 0 also writes a "latest" copy of the weights: a piece every rank holds alike, written twice."""
    return _checkpoint(mode, rank, folder, model, optimizer, scheduler, sampler, twice=("model",))


def checkpoint_written_with_pickle(mode, rank, folder, model, optimizer, scheduler, sampler):
    """Right pieces, right ranks, but written with pickle: the specification asks for torch.save."""
    return _checkpoint(mode, rank, folder, model, optimizer, scheduler, sampler, pickled=True)


def checkpoint_optimizer_on_rank_one(mode, rank, folder, model, optimizer, scheduler, sampler):
    """Right: the shared pieces split between ranks 0 and 1, each written once."""
    return _checkpoint(mode, rank, folder, model, optimizer, scheduler, sampler, on_rank0=("model", "scheduler"),
                       on_rank1=("optimizer",))


def _draw(mtbf_s, generator):
    return float(torch.empty((), dtype=torch.float64).exponential_(1 / mtbf_s, generator=generator))


def goodput_without_restart_cost(interval_s, cost_s, mtbf_s, restart_s, work_s, generator):
    """A failure loses the segment but the restart costs nothing."""
    done = wall = 0.0
    left = _draw(mtbf_s, generator)
    while done < work_s:
        segment = min(interval_s, work_s - done) + cost_s
        if left >= segment:
            wall, done, left = wall + segment, done + segment - cost_s, left - segment
        else:
            wall, left = wall + left, _draw(mtbf_s, generator)
    return done / wall


def goodput_failures_only_in_work(interval_s, cost_s, mtbf_s, restart_s, work_s, generator):
    """A failure during a checkpoint is ignored, and one during a restart too."""
    done = wall = 0.0
    left = _draw(mtbf_s, generator)
    while done < work_s:
        work = min(interval_s, work_s - done)
        if left >= work:
            wall, done, left = wall + work + cost_s, done + work, left - work
        else:
            wall, left = wall + left + restart_s, _draw(mtbf_s, generator)
    return done / wall


def _goodput(interval_s, cost_s, mtbf_s, restart_s, work_s, generator, *, whole=False, floor=False,
             last_checkpoint=True):
    """The simulation with one rule changed: whole segments only, the remainder dropped, no last checkpoint."""
    done = wall = 0.0
    left = _draw(mtbf_s, generator)
    segments = int(work_s // interval_s) if floor else None
    while (done < work_s) if segments is None else (done < segments * interval_s):
        work = interval_s if whole else min(interval_s, work_s - done)
        segment = work + (cost_s if last_checkpoint or done + work < work_s else 0.0)
        if left >= segment:
            wall, done, left = wall + segment, done + work, left - segment
            continue
        wall, left = wall + left, _draw(mtbf_s, generator)
        while left < restart_s:
            wall, left = wall + left, _draw(mtbf_s, generator)
        wall, left = wall + restart_s, left - restart_s
    return min(done, work_s) / wall


def goodput_whole_intervals_only(interval_s, cost_s, mtbf_s, restart_s, work_s, generator):
    """Every segment a whole interval, the last one too (the work past work_s is not counted)."""
    return _goodput(interval_s, cost_s, mtbf_s, restart_s, work_s, generator, whole=True)


def goodput_drops_the_remainder(interval_s, cost_s, mtbf_s, restart_s, work_s, generator):
    """Runs work_s // interval_s segments: the work left over is never done (nothing at all when work_s < interval)."""
    return _goodput(interval_s, cost_s, mtbf_s, restart_s, work_s, generator, floor=True)


def goodput_no_checkpoint_after_the_last_segment(interval_s, cost_s, mtbf_s, restart_s, work_s, generator):
    """The run ends without its last checkpoint."""
    return _goodput(interval_s, cost_s, mtbf_s, restart_s, work_s, generator, last_checkpoint=False)


def _loop(rank, world_size, settings, folder, attempt, rewind):
    model, optimizer, scheduler, sampler, starts = build(settings, rank, world_size)
    done = 0
    if attempt:
        state = torch.load(folder / f"rank{rank}.pt", weights_only=False)
        restore_state(state, model, optimizer, scheduler, sampler)
        done = state["step"] - rewind
    batch = batch_of(next(sampler), starts, 16)
    losses = []
    for step in range(done, settings.steps):
        x, y = batch
        batch = batch_of(next(sampler), starts, 16)
        losses.append(train_step(model, optimizer, scheduler, x, y))
        if (step + 1) % settings.every == 0:
            torch.save(capture_state(model, optimizer, scheduler, sampler) | {"step": step + 1},
                       folder / f"rank{rank}.pt")
    return losses


def prefetching_as_shipped(rank, world_size, settings, folder, attempt):
    """The shipped loop: the sampler saved after it drew the next step's batch (that batch is skipped)."""
    return _loop(rank, world_size, settings, folder, attempt, rewind=0)


def _fixed_loop(rank, world_size, settings, folder, attempt, *, prefetch=True, every=None, name="rank{}.pt"):
    """The fixed loop with one rule of the shipped one changed: no prefetching, saves every ``every`` steps, files
    named otherwise."""
    model, optimizer, scheduler, sampler, starts = build(settings, rank, world_size)
    path, every = folder / name.format(rank), every or settings.every
    done = 0
    if attempt:
        state = torch.load(path, weights_only=False)
        restore_state(state, model, optimizer, scheduler, sampler)
        done = state["step"]
    batch = batch_of(next(sampler), starts, 16) if prefetch else None
    losses = []
    for step in range(done, settings.steps):
        position = sampler.state_dict()
        if prefetch:
            x, y = batch
            batch = batch_of(next(sampler), starts, 16)
        else:
            x, y = batch_of(next(sampler), starts, 16)
        losses.append(train_step(model, optimizer, scheduler, x, y))
        if (step + 1) % every == 0:
            state = capture_state(model, optimizer, scheduler, sampler) | ({"sampler": position} if prefetch else {})
            torch.save(state | {"step": step + 1}, path)
    return losses


def prefetching_keeps_the_position(rank, world_size, settings, folder, attempt):
    """Right: the sampler's position before the prefetch is what the checkpoint keeps."""
    return _fixed_loop(rank, world_size, settings, folder, attempt)


def prefetching_dropped(rank, world_size, settings, folder, attempt):
    """A 'fix' that draws each batch when its step starts: the restarts are right, the prefetching is gone."""
    return _fixed_loop(rank, world_size, settings, folder, attempt, prefetch=False)


def prefetching_saves_every_step(rank, world_size, settings, folder, attempt):
    """The fix, saving after every step instead of every settings.every steps (more writes than the shipped loop)."""
    return _fixed_loop(rank, world_size, settings, folder, attempt, every=1)


def prefetching_renames_the_file(rank, world_size, settings, folder, attempt):
    """The fix, writing ckpt-rank{r}.pt instead of the shipped loop's rank{r}.pt."""
    return _fixed_loop(rank, world_size, settings, folder, attempt, name="ckpt-rank{}.pt")


def prefetching_steps_back_one(rank, world_size, settings, folder, attempt):
    """A 'fix' that resumes one step earlier instead of rewinding the sampler: a step is trained twice."""
    return _loop(rank, world_size, settings, folder, attempt, rewind=1)


WRONG = {
    "checkpoint": [checkpoint_rank0_rng_for_all, checkpoint_everything_on_every_rank, checkpoint_without_scheduler,
                   checkpoint_weights_on_every_rank, checkpoint_scheduler_on_every_rank, checkpoint_weights_twice,
                   checkpoint_written_with_pickle],
    "simulated_goodput": [goodput_without_restart_cost, goodput_failures_only_in_work, goodput_whole_intervals_only,
                          goodput_drops_the_remainder, goodput_no_checkpoint_after_the_last_segment],
    "train_prefetching": [prefetching_as_shipped, prefetching_steps_back_one, prefetching_dropped,
                          prefetching_saves_every_step, prefetching_renames_the_file],
}
RIGHT = {"checkpoint": [checkpoint_optimizer_on_rank_one], "train_prefetching": [prefetching_keeps_the_position]}
"""Correct answers other than the solution's: each must score full marks."""
