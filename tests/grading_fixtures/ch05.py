"""Wrong answers for chapter 05 (pipeline parallelism). The launched ones run on real ranks: this module is shipped
to them by value (as a notebook cell's functions are), so the ranks need not import the tests package."""

import sys

import cloudpickle
import torch
import torch.distributed as dist

from course_lib.model import lm_loss
from course_lib.parallel.schedules import Action, Kind

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def warmup_off_by_one(p, m, rank):
    """Warm-up of p - r forwards (one too many)."""
    warmup = min(p - rank, m)
    order = [f"F{i}" for i in range(warmup)]
    nf, nb = warmup, 0
    while nf < m:
        order += [f"F{nf}", f"B{nb}"]
        nf, nb = nf + 1, nb + 1
    return order + [f"B{i}" for i in range(nb, m)]


def all_forwards_then_backwards(p, m, rank):
    """GPipe's order, not 1F1B's."""
    return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]


def _one_f_one_b(p, m, rank, warmup, backward_first=False):
    order = [f"F{i}" for i in range(warmup)]
    nf, nb = warmup, 0
    while nf < m:
        order += [f"B{nb}", f"F{nf}"] if backward_first and nb < nf else [f"F{nf}", f"B{nb}"]
        nf, nb = nf + 1, nb + 1
    return order + [f"B{i}" for i in range(nb, m)]


def _schedule(p, order):
    """Every rank's ``order(rank)`` ("F3", "B3") as schedule data."""
    return [[Action(Kind(a[0]), int(a[1:]), r) for a in order(r)] for r in range(p)]


def _gpipe_schedule(p, m):
    """GPipe's schedule, written out: every rank runs all m forwards, then all m backwards."""
    return _schedule(p, lambda r: all_forwards_then_backwards(p, m, r))


def _one_f_one_b_schedule(p, m):
    """1F1B's schedule, written out: min(p - r - 1, m) warm-up forwards on rank r, then F and B alternate."""
    return _schedule(p, lambda r: _one_f_one_b(p, m, r, min(p - r - 1, m)))


def warmup_not_capped_by_m(p, m, rank):
    """Warm-up of p - r - 1 forwards even when there are fewer micro-batches (forwards of micro-batches that do
    not exist)."""
    return _one_f_one_b(p, m, rank, p - rank - 1)


def warmup_grows_with_the_rank(p, m, rank):
    """Warm-up of r forwards: the last stage, not the first, runs ahead."""
    return _one_f_one_b(p, m, rank, min(rank, m))


def steady_state_backward_first(p, m, rank):
    """In the steady state each B comes before the next F (1B1F): the last stage runs B0 before it has F0's loss."""
    return _one_f_one_b(p, m, rank, min(p - rank - 1, m), backward_first=True)


def one_f_one_b_unsplit(p, m):
    """Plain 1F1B: backwards left whole (B), no I and W."""
    return _one_f_one_b_schedule(p, m)


def gpipe_with_split_backwards(p, m):
    """All forwards, then all I, then all W: every micro-batch in flight at once (GPipe's memory)."""
    return [[Action(Kind.F, j, r) for j in range(m)] + [Action(Kind.I, j, r) for j in range(m)]
            + [Action(Kind.W, j, r) for j in range(m)] for r in range(p)]


def split_backward_without_delay(p, m):
    """1F1B with each B split into I then W at once: valid, but 1F1B's bubble (the drain is not filled)."""
    return [[b for a in rank for b in ((Action(Kind.I, a.microbatch, a.stage), Action(Kind.W, a.microbatch, a.stage))
                                      if a.kind is Kind.B else (a,))] for rank in _one_f_one_b_schedule(p, m)]


def all_weight_gradients_at_the_end(p, m):
    """Every W deferred to the end: a smaller bubble, but each rank holds all m micro-batches (GPipe's memory)."""
    out = []
    for r, rank in enumerate(_one_f_one_b_schedule(p, m)):
        out.append([Action(Kind.I, a.microbatch, r) if a.kind is Kind.B else a for a in rank]
                   + [Action(Kind.W, j, r) for j in range(m)])
    return out


def weight_before_input(p, m):
    """W of a micro-batch before its I: the dependency is broken."""
    return [[b for a in rank for b in ((Action(Kind.W, a.microbatch, a.stage), Action(Kind.I, a.microbatch, a.stage))
                                      if a.kind is Kind.B else (a,))] for rank in _one_f_one_b_schedule(p, m)]


def _h_shape(stage, x, m):
    return (x.shape[0] // m, x.shape[1], stage.blocks[next(iter(stage.blocks))].attn.q_proj.in_features)


def _two_stage_step(stage, x, y, m, schedule, loss_scale):
    """A two-stage step that runs ``schedule(2, m)``'s compute actions and back-propagates ``loss_scale(loss)``."""
    rank, xs, ys, shape = dist.get_rank(), x.chunk(m), y.chunk(m), _h_shape(stage, x, m)
    saved, sends, losses = {}, [], []
    for a in [a for a in schedule(2, m)[rank] if a.is_compute]:
        j = a.microbatch
        if a.kind is Kind.F and rank == 0:
            out = stage(xs[j])
            sends.append(dist.isend(out.detach(), dst=1))
            saved[j] = out
        elif a.kind is Kind.F:
            h = torch.empty(shape)
            dist.irecv(h, src=0).wait()
            h.requires_grad_(True)
            loss = lm_loss(stage(h), ys[j])
            losses.append(loss.item())
            saved[j] = (h, loss_scale(loss))
        elif rank == 0:
            g = torch.empty(shape)
            dist.irecv(g, src=1).wait()
            saved.pop(j).backward(g)
        else:
            h, scaled = saved.pop(j)
            scaled.backward()
            sends.append(dist.isend(h.grad, dst=0))
    for w in sends:
        w.wait()
    return losses


def _deep_step(stage, x, y, m, schedule=_one_f_one_b_schedule, scale=True, echo=False, blocking=False, by_rows=False):
    """A p-stage step running ``schedule(p, m)``'s compute actions."""
    rank, p = dist.get_rank(), dist.get_world_size()
    xs, ys, shape = x.chunk(m), y.chunk(m), _h_shape(stage, x, m)
    ins, outs, sends, losses = {}, {}, [], []

    def send(t, dst):
        if blocking:
            dist.send(t, dst=dst)
        else:
            sends.append(dist.isend(t, dst=dst))

    def recv(src):
        t = torch.empty(shape)
        if blocking:
            dist.recv(t, src=src)
        else:
            dist.irecv(t, src=src).wait()
        return t

    for a in [a for a in schedule(p, m)[rank] if a.is_compute]:
        j = a.microbatch
        if a.kind is Kind.F:
            h = xs[j] if rank == 0 else recv(rank - 1).requires_grad_(True)
            out = stage(h)
            if rank == p - 1:
                loss = lm_loss(out, ys[j])
                losses.append(loss.item())
                out = loss * (x.shape[0] // m) / x.shape[0] if by_rows else loss / m if scale else loss
            else:
                send(out.detach(), rank + 1)
            ins[j], outs[j] = h, out
        else:
            g = None if rank == p - 1 else recv(rank + 1)
            torch.autograd.backward(outs.pop(j), g)
            h = ins.pop(j)
            if rank > 0:
                send(g if echo and g is not None else h.grad, rank - 1)
    for w in sends:
        w.wait()
    return losses


def deep_step_gpipe_order(stage, x, y, m):
    """All forwards, then all backwards: right gradients, but GPipe's order (m activations held), not 1F1B's."""
    return _deep_step(stage, x, y, m, schedule=_gpipe_schedule)


def deep_step_without_loss_scale(stage, x, y, m):
    """Each micro-batch back-propagates its full mean loss: every stage's gradients m x too large."""
    return _deep_step(stage, x, y, m, scale=False)


def deep_step_middle_echoes_the_gradient(stage, x, y, m):
    """A middle rank passes back the gradient it received (of its output) instead of its input's gradient: right
    shape, but its own blocks are skipped in the chain rule."""
    return _deep_step(stage, x, y, m, echo=True)


def deep_step_with_all_reduce(stage, x, y, m):
    """Averages the losses with an all-reduce: a collective the pipeline must not use."""
    t = torch.zeros(1)
    dist.all_reduce(t)
    return _deep_step(stage, x, y, m)


def deep_step_blocking_messages(stage, x, y, m):
    """Blocking dist.send / dist.recv in 1F1B's order: deadlocks on gloo. In the steady state rank 1 sends micro-batch
    j+1's activation to rank 2 while rank 2 sends micro-batch j's gradient to rank 1; gloo's send returns only once
    the peer has posted the matching receive, so each waits for the other."""
    return _deep_step(stage, x, y, m, blocking=True)


def deep_step_scaled_by_rows(stage, x, y, m):
    """Right: each micro-batch mean weighted by its rows over the batch's (b / batch = 1 / m)."""
    return _deep_step(stage, x, y, m, by_rows=True)


def gpipe_divided_by_rows(stage, x, y, m):
    """The colleague's bug, left in: each micro-batch loss divided by its rows b instead of m."""
    return _two_stage_step(stage, x, y, m, _gpipe_schedule, lambda loss: loss / (x.shape[0] // m))


def gpipe_without_loss_scale(stage, x, y, m):
    """GPipe's order, no loss scale at all: gradients m x too large."""
    return _two_stage_step(stage, x, y, m, _gpipe_schedule, lambda loss: loss)


def gpipe_fixed_but_in_1f1b_order(stage, x, y, m):
    """Right gradients, but the step of exercise 3 (1F1B) instead of the colleague's GPipe schedule."""
    return _two_stage_step(stage, x, y, m, _one_f_one_b_schedule, lambda loss: loss / m)


def gpipe_scaled_by_batch(stage, x, y, m):
    """Each micro-batch loss divided by the batch's rows: gradients b x too small."""
    return _two_stage_step(stage, x, y, m, _gpipe_schedule, lambda loss: loss / x.shape[0])


def gpipe_scaled_by_stages(stage, x, y, m):
    """Each micro-batch loss divided by the number of stages (2) instead of m."""
    return _two_stage_step(stage, x, y, m, _gpipe_schedule, lambda loss: loss / 2)


def hides_as_a_list():
    """The right shape as a list, not the (batch, m) tuple asked for."""
    return [9, 3]


def hides_with_the_chapter_shape():
    """The notebook's own shape (batch 8, m 4): b = 2, the bug shows."""
    return 8, 4


def hides_with_one_micro_batch():
    """m = 1: no pipeline at all (b = batch and the factor is 1/b: a different test), and the rule says m >= 2."""
    return 4, 1


def hides_with_floats():
    """The right shape as floats."""
    return 9.0, 3.0


def hides_when_batch_equals_m():
    """b = 1 row per micro-batch: the factor m / b = m."""
    return 4, 4


RIGHT = {"deep_pipeline_step": [deep_step_scaled_by_rows]}
"""Correct answers other than the solution's: each must score full marks."""

WRONG = {
    "one_f_one_b_order": [warmup_off_by_one, all_forwards_then_backwards, warmup_not_capped_by_m,
                          warmup_grows_with_the_rank, steady_state_backward_first],
    "zb_h1_schedule": [split_backward_without_delay, all_weight_gradients_at_the_end, weight_before_input,
                       one_f_one_b_unsplit, gpipe_with_split_backwards],
    "deep_pipeline_step": [deep_step_gpipe_order, deep_step_without_loss_scale, deep_step_middle_echoes_the_gradient,
                           deep_step_with_all_reduce, deep_step_blocking_messages],
    "gpipe_step": [gpipe_divided_by_rows, gpipe_without_loss_scale, gpipe_fixed_but_in_1f1b_order,
                   gpipe_scaled_by_batch, gpipe_scaled_by_stages],
    "shape_that_hides_the_bug": [hides_with_the_chapter_shape, hides_with_one_micro_batch, hides_with_floats,
                                 hides_when_batch_equals_m, hides_as_a_list],
}
