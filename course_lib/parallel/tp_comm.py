"""The communication operators of tensor and sequence parallelism, as autograd Functions.

Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, Sec. 3) splits an MLP ``Z = GeLU(X A) B`` with A
by columns and B by rows: rank i computes ``Z_i = GeLU(X A_i) B_i`` and ``Z = sum_i Z_i``. Two
conjugate operators mark where the t ranks talk: **f** (identity forward, all-reduce backward, as
``dL/dX = sum_i dL/dX_i``) and **g** (all-reduce forward, identity backward). A bare
``dist.all_reduce`` in ``forward`` is unseen by autograd: f's backward would lose it.

Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.2.2) shards the norm/dropout
regions along the sequence with the paper's pair: **g** all-gathers forward and reduce-scatters
backward (before a column-parallel linear), **g-bar** the reverse (after a row-parallel one):
(t-1)/t x V bytes per rank each, the 2(t-1)/t x V of the all-reduce they replace (V = b*s*h).
``sequence_parallel_linears`` saves the s/t shard and all-gathers it again in backward, overlapped
with the input-gradient GEMM (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``): a
TP + SP block's activations are an unsplit block's / t for one more all-gather of V per region.

``gather_from_`` / ``scatter_to_tensor_parallel_region`` (last dim) serve ``gather_output=True`` /
``input_is_parallel=False``. Activations: ``[batch, seq, hidden]``; every collective goes through
``course_lib.comm`` (logged), in the input's dtype and device. Chapter 04 derives them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import comm

SEQ_DIM = 1
"""The sequence dimension of ``[batch, seq, hidden]`` activations."""


def _world(group: comm.Group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def all_reduce_sum(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """A summed copy of ``x`` over ``group`` (one logged all-reduce); x itself is untouched."""
    out = x.contiguous().clone()
    comm.all_reduce(out, group=group)
    return out


def all_gather_along(x: torch.Tensor, dim: int, group: comm.Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (one logged all-gather of the full tensor)."""
    n, _ = _world(group)
    if n == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, front, group=group)
    return out.movedim(0, dim).contiguous()  # one copy: its readers save one storage


def _start_sequence_gather(x: torch.Tensor, group: comm.Group) -> tuple[Any, torch.Tensor]:
    """Launch the all-gather of the sequence shards ``x`` [b, s/t, ...] (async); returns (work,
    [t*s/t, b, ...])."""
    n, _ = _world(group)
    front = x.movedim(SEQ_DIM, 0).contiguous()
    out = torch.empty((n * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    return comm.all_gather(out, front, group=group, async_op=True), out


def reduce_scatter_along(x: torch.Tensor, dim: int, group: comm.Group) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep chunk ``rank`` of ``dim`` (one logged reduce-scatter of
    ``x``)."""
    n, _ = _world(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {n} ranks: "
                         f"the size must be divisible by {n}")
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // n, *front.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, front, group=group)
    return out.movedim(0, dim)


def split_along(x: torch.Tensor, dim: int, group: comm.Group) -> torch.Tensor:
    """This rank's contiguous chunk of ``dim`` (no communication)."""
    n, r = _world(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {n} ranks: "
                         f"the size must be divisible by {n}")
    return x.chunk(n, dim=dim)[r].contiguous()


# --------------------------------------------------------------------------------------------------
# Tensor parallelism: f and g


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's **f**: forward identity, backward all-reduce of the input gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_sum(grad, ctx.group), None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's **g**: forward all-reduce of the partial sums, backward identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dim forward (``gather_output``); backward keeps this rank's
    slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        ctx.group = group
        return all_gather_along(x, -1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return split_along(grad, -1, ctx.group), None


class ScatterToTensorParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather backward
    (``input_is_parallel=False``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        ctx.group = group
        return split_along(x, -1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_along(grad, -1, ctx.group), None


# --------------------------------------------------------------------------------------------------
# Sequence parallelism


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward (enters a TP region under
    SP)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        ctx.group = group
        return all_gather_along(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return reduce_scatter_along(grad, SEQ_DIM, ctx.group), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward (leaves a TP region under
    SP)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_along(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_along(grad, SEQ_DIM, ctx.group), None


class ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's chunk of the sequence forward, all-gather backward (no forward
    communication)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        ctx.group = group
        return split_along(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_along(grad, SEQ_DIM, ctx.group), None


class SequenceParallelLinears(torch.autograd.Function):
    """SP's g followed by k column-parallel linears that read the same gathered input, saving only
    the s/t shard.

    Forward: X = all-gather(x) along the sequence, ``Y_j = X W_j^T + b_j``; saved: x [b, s/t, h] and
    the weights. Backward: start the all-gather of x again (async), compute ``dX = sum_j dY_j W_j``
    meanwhile (the overlap Megatron-LM builds), wait, reduce-scatter dX to dx, and
    ``dW_j = dY_j^T X``, ``db_j = sum dY_j``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group,
                *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        work, full = _start_sequence_gather(x, group)
        work.wait()
        xf = full.movedim(0, SEQ_DIM)
        weights, biases = params[0::2], params[1::2]
        ctx.group, ctx.has_bias = group, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(xf, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        work, full = _start_sequence_gather(x, ctx.group)  # the re-gather, behind the dX GEMMs
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_full = sum(g @ w for g, w in zip(grads, weights, strict=True))
            grad_x = reduce_scatter_along(grad_full, SEQ_DIM, ctx.group)
        work.wait()
        xf = full.movedim(0, SEQ_DIM).reshape(-1, x.shape[-1])
        first = getattr(ctx, "n_args", 2)  # inputs before the weights: x, group (+ a variant's)
        out: list[torch.Tensor | None] = [grad_x] + [None] * (first - 1)
        for j, (g, has_bias) in enumerate(zip(grads, ctx.has_bias, strict=True)):
            g2 = g.reshape(-1, g.shape[-1])
            out.append(g2.t() @ xf if ctx.needs_input_grad[first + 2 * j] else None)
            out.append(g2.sum(0) if has_bias and ctx.needs_input_grad[first + 1 + 2 * j] else None)
        return tuple(out)


def sequence_parallel_linears(x: torch.Tensor,
                              linears: list[tuple[torch.Tensor, torch.Tensor | None]],
                              group: comm.Group = None) -> tuple[torch.Tensor, ...]:
    """``[all-gather(x) W_j^T + b_j for (W_j, b_j) in linears]`` with x the sequence shard [b, s/t,
    h]: one all-gather forward, one all-gather (the re-gather) and one reduce-scatter backward; only
    x is saved."""
    if dist.get_world_size(group) == 1:
        return tuple(F.linear(x, w, b) for w, b in linears)
    return SequenceParallelLinears.apply(x, group, *(p for wb in linears for p in wb))


def copy_to_tensor_parallel_region(x: torch.Tensor, group: comm.Group = None) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: comm.Group = None) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return ReduceFromTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: comm.Group = None) -> torch.Tensor:
    return GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: comm.Group = None) -> torch.Tensor:
    return ScatterToTensorParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: comm.Group = None) -> torch.Tensor:
    """SP's g: all-gather along the sequence forward, reduce-scatter backward."""
    return GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor,
                                               group: comm.Group = None) -> torch.Tensor:
    """SP's g-bar, g's conjugate: reduce-scatter along the sequence forward, all-gather backward."""
    return ReduceScatterToSequenceParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: comm.Group = None) -> torch.Tensor:
    return ScatterToSequenceParallelRegion.apply(x, group)


f = copy_to_tensor_parallel_region
"""Megatron's name for the operator before a column-parallel region."""
g = reduce_from_tensor_parallel_region
"""Megatron's name for the operator after a row-parallel region."""
