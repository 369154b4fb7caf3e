"""Wrong answers for chapter 10 (failures at scale)."""

import torch

from course_lib.failures.restart import batch_of, build, capture_state, restore_state, train_step


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


def prefetching_steps_back_one(rank, world_size, settings, folder, attempt):
    """A 'fix' that resumes one step earlier instead of rewinding the sampler: a step is trained twice."""
    return _loop(rank, world_size, settings, folder, attempt, rewind=1)


WRONG = {
    "checkpoint": [checkpoint_rank0_rng_for_all, checkpoint_everything_on_every_rank, checkpoint_without_scheduler],
    "simulated_goodput": [goodput_without_restart_cost, goodput_failures_only_in_work],
    "train_prefetching": [prefetching_as_shipped, prefetching_steps_back_one],
}
