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
    """Treats every stage as ZeRO-3 (the seeds' 'linear in N' read too broadly)."""
    return (4 + k) * psi / (n_d if stage else 1)


def kv_forgets_values(n_layer, n_kv_head, head_dim, tokens, batch, bytes_per_value):
    """Caches only the keys."""
    return n_layer * n_kv_head * head_dim * bytes_per_value * tokens * batch


def kv_forgets_batch(n_layer, n_kv_head, head_dim, tokens, batch, bytes_per_value):
    """One sequence's cache, whatever the batch."""
    return 2 * n_layer * n_kv_head * head_dim * bytes_per_value * tokens


WRONG = {
    "param_state_bytes": [forgets_master_weights, adam_state_in_weight_precision],
    "zero_bytes_per_device": [zero_stage2_forgets_gradients, zero_everything_sharded],
    "kv_cache_bytes": [kv_forgets_values, kv_forgets_batch],
}
