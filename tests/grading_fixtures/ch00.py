"""Wrong answers for chapter 00 (memory budgets)."""


def forgets_master_weights(precision, optimizer):
    """Mixed precision without the fp32 master copy of the weights."""
    width = {"fp32": 4, "bf16": 2, "mixed": 2}[precision]
    state = 2 if precision == "bf16" else 4
    return width, width, {"sgd": 0, "sgd_momentum": 1, "adamw": 2}[optimizer] * state


def adam_state_in_weight_precision(precision, optimizer):
    """Optimizer state stored at the weights' width (2 bytes in mixed precision)."""
    width = {"fp32": 4, "bf16": 2, "mixed": 2}[precision]
    master = 4 if precision == "mixed" else 0
    return width, width, master + {"sgd": 0, "sgd_momentum": 1, "adamw": 2}[optimizer] * width


def zero_stage2_forgets_gradients(psi, n_d, stage, k=12):
    """Stage 2 shards only the optimizer state, like stage 1."""
    if stage == 0:
        return (4 + k) * psi
    if stage in (1, 2):
        return 4 * psi + k * psi / n_d
    return (4 + k) * psi / n_d


def zero_everything_sharded(psi, n_d, stage, k=12):
    """Treats every stage as ZeRO-3 (the summaries' 'linear in N' read too broadly)."""
    return (4 + k) * psi / (n_d if stage else 1)


def kv_forgets_values(n_layer, n_kv_head, head_dim, tokens, batch, bytes_per_value):
    """Caches only the keys."""
    return n_layer * n_kv_head * head_dim * bytes_per_value * tokens * batch


def kv_forgets_batch(n_layer, n_kv_head, head_dim, tokens, batch, bytes_per_value):
    """One sequence's cache, whatever the batch."""
    return 2 * n_layer * n_kv_head * head_dim * bytes_per_value * tokens


def _search(model, gpu, seq_len, *, tps=(1, 2, 4, 8), sp=True, cap_gib=False, recompute="full"):
    from course_lib.estimates.hardware import GPUS
    from course_lib.estimates.layout import ParallelLayout
    from course_lib.estimates.memory import training_memory
    from course_lib.estimates.memory_budget import GB

    cap = GPUS[gpu].nominal_gib * 2**30 if not cap_gib else GPUS[gpu].nominal_gib * GB
    best = None
    for tp in tps:
        for pp in (1, 2, 4, 8, 16):
            for dp in (2 ** k for k in range(11)):
                layout = ParallelLayout(dp=dp, tp=tp, pp=pp, zero_stage=3, sp=sp and tp > 1)
                total = training_memory(model, micro_batch=1, seq_len=seq_len, recompute=recompute,
                                        layout=layout).total
                if total <= cap and (best is None or tp * pp * dp < best[0]):
                    best = (tp * pp * dp, {"tp": tp, "pp": pp, "dp": dp})
    return best


def fewest_without_sequence_parallel(model, gpu, seq_len):
    """Forgets SP with TP: the activations stay whole on every TP rank, so it needs more GPUs."""
    return _search(model, gpu, seq_len, sp=False)


def fewest_reads_80gb_as_80e9_bytes(model, gpu, seq_len):
    """Takes the card's "80GB" as 80 x 10^9 bytes instead of 80 GiB."""
    return _search(model, gpu, seq_len, cap_gib=True)


def fewest_without_tensor_parallel(model, gpu, seq_len):
    """Searches ZeRO-3 x PP only: misses the smaller TP layouts."""
    return _search(model, gpu, seq_len, tps=(1,))


def _states(weights: float, grads: float, states: float, shard: float, zero: int) -> dict[str, float]:
    return {"parameters": weights / (shard if zero >= 3 else 1), "gradients": grads / (shard if zero >= 2 else 1),
            "optimizer_state": states / (shard if zero >= 1 else 1)}


def zero_over_every_gpu(psi, tp, pp, dp, zero, k=12):
    """The colleague's bug, left in: ZeRO shards over all tp x pp x dp GPUs, not over the dp replicas."""
    local = psi / (tp * pp)
    return _states(2 * local, 2 * local, k * local, tp * pp * dp, zero)


def forgets_pipeline_stages(psi, tp, pp, dp, zero, k=12):
    """Each GPU holds psi / tp parameters: the pipeline's split of the layers is forgotten."""
    local = psi / tp
    return _states(2 * local, 2 * local, k * local, dp, zero)


def splits_only_the_weights(psi, tp, pp, dp, zero, k=12):
    """TP and PP divide the weights, but the gradients and optimizer state are counted for the whole model."""
    return _states(2 * psi / (tp * pp), 2 * psi, k * psi, dp, zero)


def _bytes(precision, optimizer, *, grads=None, states=None, master=None):
    width = {"fp32": 4, "bf16": 2, "mixed": 2}[precision]
    state = 2 if precision == "bf16" else 4
    n = {"sgd": 0, "sgd_momentum": 1, "adamw": 2}[optimizer] if states is None else states[optimizer]
    keep = (4 if precision == "mixed" else 0) if master is None else master(precision)
    return width, width if grads is None else grads, keep + n * state


def grads_always_fp32(precision, optimizer):
    """Gradients counted at 4 bytes whatever the precision."""
    return _bytes(precision, optimizer, grads=4)


def momentum_counted_as_two_states(precision, optimizer):
    """SGD with momentum given two states, like Adam."""
    return _bytes(precision, optimizer, states={"sgd": 0, "sgd_momentum": 2, "adamw": 2})


def pure_bf16_keeps_a_master_copy(precision, optimizer):
    """Pure bf16 given an fp32 master copy too (only mixed precision keeps one)."""
    return _bytes(precision, optimizer, master=lambda p: 0 if p == "fp32" else 4)


def _zero(psi, n_d, stage, k, *, shard):
    """(weights, gradients, optimizer) divided by n_d where ``shard(stage)`` says so."""
    w, g, o = shard(stage)
    return 2 * psi / (n_d if w else 1) + 2 * psi / (n_d if g else 1) + k * psi / (n_d if o else 1)


def zero_stage1_shards_the_weights(psi, n_d, stage, k=12):
    """Stage 1 taken to shard the weights with the optimizer state."""
    return _zero(psi, n_d, stage, k, shard=lambda s: (s >= 1, s >= 2, s >= 1))


def zero_k_hard_coded(psi, n_d, stage, k=12):
    """K written as 12 whatever k says (fp32 gradient accumulation gives 16)."""
    return _zero(psi, n_d, stage, 12, shard=lambda s: (s >= 3, s >= 2, s >= 1))


def zero_stage3_keeps_the_weights(psi, n_d, stage, k=12):
    """Stage 3 taken as stage 2: the weights stay whole on every device."""
    return _zero(psi, n_d, stage, k, shard=lambda s: (False, s >= 2, s >= 1))


def kv_bytes_hard_coded(n_layer, n_kv_head, head_dim, tokens, batch, bytes_per_value):
    """bf16 assumed: 2 bytes a value whatever bytes_per_value says."""
    return 2 * n_layer * n_kv_head * head_dim * 2 * tokens * batch


def kv_one_layer(n_layer, n_kv_head, head_dim, tokens, batch, bytes_per_value):
    """The cache of one layer: n_layer forgotten."""
    return 2 * n_kv_head * head_dim * bytes_per_value * tokens * batch


def kv_tokens_and_batch_added(n_layer, n_kv_head, head_dim, tokens, batch, bytes_per_value):
    """tokens + batch instead of tokens x batch."""
    return 2 * n_layer * n_kv_head * head_dim * bytes_per_value * (tokens + batch - 1)


def fewest_at_8192_tokens(model, gpu, seq_len):
    """The sequence length read as 8192 whatever seq_len says."""
    return _search(model, gpu, 8192)


def fewest_with_selective_recompute(model, gpu, seq_len):
    """Budgets selective recomputation instead of the full recomputation the exercise asks for."""
    return _search(model, gpu, seq_len, recompute="selective")


def zero_shards_every_category(psi, tp, pp, dp, zero, k=12):
    """Every category divided by dp as soon as zero > 0, whatever the stage."""
    local = psi / (tp * pp)
    return _states(2 * local, 2 * local, k * local, dp, 3 if zero else 0)


def model_states_k_hard_coded(psi, tp, pp, dp, zero, k=12):
    """The optimizer state at 12 bytes whatever k says."""
    local = psi / (tp * pp)
    return _states(2 * local, 2 * local, 12 * local, dp, zero)


WRONG = {
    "param_state_bytes": [forgets_master_weights, adam_state_in_weight_precision, grads_always_fp32,
                          momentum_counted_as_two_states, pure_bf16_keeps_a_master_copy],
    "zero_bytes_per_device": [zero_stage2_forgets_gradients, zero_everything_sharded, zero_stage1_shards_the_weights,
                              zero_k_hard_coded, zero_stage3_keeps_the_weights],
    "kv_cache_bytes": [kv_forgets_values, kv_forgets_batch, kv_bytes_hard_coded, kv_one_layer,
                       kv_tokens_and_batch_added],
    "fewest_gpus": [fewest_without_sequence_parallel, fewest_reads_80gb_as_80e9_bytes, fewest_without_tensor_parallel,
                    fewest_at_8192_tokens, fewest_with_selective_recompute],
    "model_states_per_gpu": [zero_over_every_gpu, forgets_pipeline_stages, splits_only_the_weights,
                             zero_shards_every_category, model_states_k_hard_coded],
}
