"""Wrong answers for chapter 05 (pipeline parallelism)."""

from course_lib.model import lm_loss


def bubble_over_m(p, m):
    """Megatron's bubble/ideal ratio (p-1)/m given where the fraction of total time is asked."""
    return (p - 1) / m


def bubble_off_by_one(p, m):
    """Counts p idle slots instead of p - 1."""
    return p / (m + p)


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


def loss_not_divided_by_m(model, x, y, m):
    """Gradients m x too large: the classic pipeline bug."""
    for xm, ym in zip(x.chunk(m), y.chunk(m), strict=True):
        lm_loss(model(xm), ym).backward()


def only_last_microbatch(model, x, y, m):
    """Zeroes the gradients before every micro-batch."""
    for xm, ym in zip(x.chunk(m), y.chunk(m), strict=True):
        model.zero_grad()
        (lm_loss(model(xm), ym) / m).backward()


WRONG = {
    "gpipe_bubble_fraction": [bubble_over_m, bubble_off_by_one],
    "one_f_one_b_order": [warmup_off_by_one, all_forwards_then_backwards],
    "microbatch_gradients": [loss_not_divided_by_m, only_last_microbatch],
}
