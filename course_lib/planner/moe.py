"""The planner's mixture-of-experts model: the matmul weights a token meets in a block (DeepSeekMoE's fine-grained
and shared experts), the leading dense blocks, and node-limited routing."""

from __future__ import annotations

from functools import lru_cache

from course_lib.model_config import GPTConfig, attention_params, mlp_params, shared_expert_params
from course_lib.planner.candidate import Candidate
from course_lib.planner.candidate import rank_dense_layers as _rank_dense_layers


@lru_cache(maxsize=1_000)
def layer_matmul_params(cfg: GPTConfig, dense: bool = False) -> tuple[int, int]:
    """(dense part, active routed experts): the matmul weights one token meets in one block. Dense block:
    attention + the MLP of d_ff, no experts. MoE block (DeepSeekMoE, Dai et al. 2024): attention + the router
    h x E + the shared experts' MLP of n_s f_e, and top_k routed MLPs of f_e = ``expert_d_ff``."""
    if not cfg.n_expert or dense:
        return attention_params(cfg) + mlp_params(cfg), 0
    return (attention_params(cfg) + cfg.d_model * cfg.n_expert + shared_expert_params(cfg),
            cfg.top_k * mlp_params(cfg, cfg.expert_ffn_dim))


def leading_dense(cfg: GPTConfig, dense_layers: int) -> int:
    """How many of the first blocks are dense: ``dense_layers`` of an MoE model (at most n_layer), 0 otherwise."""
    return min(dense_layers, cfg.n_layer) if cfg.n_expert else 0


@lru_cache(maxsize=1_000)
def active_params(cfg: GPTConfig, dense_layers: int = 0) -> int:
    """Matmul weights a token uses: every block's ``layer_matmul_params`` (the first ``dense_layers`` dense) plus
    the LM head v x h (the real vocabulary): 6 x this per token is the model-FLOPs count of MFU (PaLM)."""
    d = leading_dense(cfg, dense_layers)
    return (d * sum(layer_matmul_params(cfg, dense=True)) + (cfg.n_layer - d) * sum(layer_matmul_params(cfg))
            + cfg.vocab_size * cfg.d_model)


def rank_dense_layers(cand: Candidate, n_layer: int, dense_layers: int) -> list[int]:
    """Per pipeline rank, how many of the first ``dense_layers`` blocks it holds (its chunks r, r + p, ...)."""
    return list(_rank_dense_layers(cand.pp, cand.v, n_layer, dense_layers))


def route_node_limit(cfg: GPTConfig, nodes: int, override: int | None = None) -> int | None:
    """The most nodes one token's experts lie on (None: no limit). ``override`` (``Assumptions.node_limit``)
    wins; else the model's node-limited routing: ``topk_group`` = M of ``n_group`` contiguous groups, each group
    on ceil(nodes / n_group) of the EP group's nodes (the experts are laid out in rank order), so M x that."""
    if override is not None:
        return override
    if not cfg.n_expert or cfg.topk_group is None or cfg.topk_group == cfg.n_group:
        return None
    return min(nodes, cfg.topk_group * -(-nodes // cfg.n_group))
