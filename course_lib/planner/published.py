"""Published large training runs, described from their papers (and from NVIDIA's own performance tables), to check
the planner against (never to tune it).

Each ``PublishedRun`` is a model shape, a cluster, a batch, the mesh the authors used and the MFU they report (or
that follows from what they report: the derivation is in ``mfu_source``), with ``gaps``: what of the setup the
planner cannot express. ``check`` plans the run twice: with the published mesh pinned (its predicted MFU against
the published one) and left free (the place of the published mesh among the distinct meshes, best first).

The constants of ``planner_model.Assumptions`` were not chosen on these runs; a run that needs a stated
assumption (Megatron-LM's ``--tp-comm-overlap``, DeepSeek-V3's overlapped all-to-all and node-limited routing)
carries it in ``assume``, set from what the paper says it did, not fitted to its MFU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from course_lib.model_config import GPTConfig
from course_lib.planner.model import Assumptions, Cluster, Prediction, predict
from course_lib.planner.search import MESH_AXES, PlanResult, candidates, cluster, plan

# Megatron-LM's weak-scaling runs on H100 (Megatron-Core r0.8.0, its README's table): GPT models with
# sequence length 4096, vocabulary 131072, untied embeddings, MHA, 4h GELU MLP; DP 48 throughout, with
# --tp-comm-overlap. (name, heads, hidden, layers, TP, PP, GPUs, global batch, published MFU)
MEGATRON_WEAK_SCALING: list[tuple[str, int, int, int, int, int, int, int, float]] = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 0.41),
    ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 0.47),
    ("16B", 48, 6144, 32, 4, 1, 192, 192, 0.49),
    ("32B", 56, 7168, 48, 8, 1, 384, 192, 0.46),
    ("70B", 64, 8192, 84, 8, 2, 768, 384, 0.42),
    ("119B", 80, 10240, 92, 8, 4, 1536, 768, 0.43),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 0.44),
    ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 0.48),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 0.47),
]
MEGATRON_SEQ = 4096


def megatron_config(name: str, heads: int, hidden: int, layers: int) -> GPTConfig:
    return GPTConfig(name=f"megatron-{name}", vocab_size=131072, seq_len=MEGATRON_SEQ, n_layer=layers,
                     n_head=heads, d_model=hidden)


MEGATRON_SPACE: dict[str, tuple] = {"zero_stages": (1,), "recomputes": ("selective",), "micro_batches": (1, 2, 4),
                                    "schedules": ("1f1b", "interleaved")}
"""The search space of those runs: Megatron's distributed optimizer (ZeRO-1), selective recomputation, its
1F1B and interleaved schedules."""

TP_OVERLAP = 0.5
"""The stated share of TP traffic ``--tp-comm-overlap`` hides: half, a middle value set before the check, not
fitted (NVIDIA's Transformer Engine userbuffers overlap the all-gather / reduce-scatter of each GEMM with the
GEMM itself, chunk by chunk; the first and last chunks stay exposed)."""


@dataclass(frozen=True)
class PublishedRun:
    """One published run: what the planner needs, and what it cannot express (``gaps``)."""

    name: str
    source: str
    cfg: GPTConfig
    cluster: str
    nodes: int
    global_batch: int
    seq_len: int
    mesh: dict[str, int]
    mfu: float
    mfu_source: str
    full_attention: bool = True  # the paper's MFU counts attention without the causal halving
    pinned: dict[str, object] = field(default_factory=dict)  # other published settings (zero, recompute, ...)
    space: dict[str, object] = field(default_factory=dict)
    assume: Assumptions = field(default_factory=Assumptions)
    gaps: str = ""
    study_fixed: dict[str, int] = field(default_factory=dict)  # what the study itself held fixed (free plan)


def _megatron_runs() -> list[PublishedRun]:
    return [PublishedRun(f"Megatron-LM {name}", "Megatron-LM README, H100 weak-scaling table (Megatron-Core r0.8.0)",
                         megatron_config(name, heads, h, layers), "dgx-h100", gpus // 8, gb, MEGATRON_SEQ,
                         {"dp": 48, "tp": tp, "pp": pp, "cp": 1}, mfu, "the table's MFU column",
                         pinned={"zero_stage": 1}, space=MEGATRON_SPACE, assume=Assumptions(tp_overlap=TP_OVERLAP),
                         gaps="the table's own batch per row; the planner has no launch or optimizer-step overhead",
                         study_fixed={"dp": 48, "cp": 1})
            for name, heads, h, layers, tp, pp, gpus, gb, mfu in MEGATRON_WEAK_SCALING]


LLAMA3_405B = GPTConfig(name="llama3-405b", vocab_size=128256, seq_len=8192, n_layer=126, n_head=128, n_kv_head=8,
                        d_model=16384, d_ff=53248, mlp="swiglu", norm="rmsnorm", pos="rope", bias=False)
DEEPSEEK_V3_LIKE = GPTConfig(name="deepseek-v3-like", vocab_size=129280, seq_len=4096, n_layer=61, n_head=128,
                             d_model=7168, d_ff=18432, mlp="swiglu", norm="rmsnorm", pos="rope", bias=False,
                             n_expert=256, top_k=8, expert_d_ff=2048, n_shared_expert=1, n_group=8, topk_group=4)
"""DeepSeek-V3 as its report's Sec. 4.2 gives it: 61 blocks, h 7168, 256 routed experts of 2048 and 1 shared,
top-8, node-limited to 4 of 8 groups; the first 3 blocks dense MLPs of 18432 (``Assumptions.dense_layers=3``);
attention as MHA of 128 heads (MLA is not modelled)."""
DEEPSEEK_V3_DENSE_LAYERS = 3
QWEN3_30B_A3B = GPTConfig(name="qwen3-30b-a3b", vocab_size=151936, seq_len=4096, n_layer=48, n_head=32, n_kv_head=4,
                          d_model=2048, d_ff=6144, mlp="swiglu", norm="rmsnorm", pos="rope", bias=False,
                          n_expert=128, top_k=8, expert_d_ff=768)
"""Qwen3-30B-A3B as its model card's config.json gives it (Qwen team 2025; restated as Megatron arguments in
THUDM's slime, scripts/models/qwen3-30B-A3B.sh): 48 blocks, h 2048, 32 query heads and 4 K/V heads, 128 routed
experts of 768, top-8, no shared expert, every block MoE, vocabulary 151,936, untied. Its heads are 128 wide
(q is 4096 wide, not h): ``GPTConfig`` ties head_dim to h / n_head = 64, so attention is priced at half its
projection width (a stated gap)."""
KIMI_K2 = GPTConfig(name="kimi-k2", vocab_size=163840, seq_len=4096, n_layer=61, n_head=64, d_model=7168,
                    d_ff=18432, mlp="swiglu", norm="rmsnorm", pos="rope", bias=False, n_expert=384, top_k=8,
                    expert_d_ff=2048, n_shared_expert=1)
"""Kimi K2 (Moonshot AI 2025) as its Megatron arguments give it (THUDM's slime, scripts/models/kimi-k2.sh): 61
blocks, h 7168, 64 heads, 384 routed experts of 2048 and one shared expert of 2048, top-8, no group limit, the
first block a dense MLP of 18432 (``Assumptions.dense_layers=1``), vocabulary 163,840, untied. Its attention is
MLA (modelled as MHA of 64 heads, as DeepSeek-V3's is here)."""
KIMI_K2_DENSE_LAYERS = 1
MT_NLG_530B = GPTConfig(name="mt-nlg-530b", vocab_size=50257, seq_len=2048, n_layer=105, n_head=128, d_model=20480)
BLOOM_176B = GPTConfig(name="bloom-176b", vocab_size=250880, seq_len=2048, n_layer=70, n_head=112, d_model=14336,
                       tie_embeddings=True)
OPT_175B = GPTConfig(name="opt-175b", vocab_size=50272, seq_len=2048, n_layer=96, n_head=96, d_model=12288)


OTHER_RUNS: list[PublishedRun] = [
    PublishedRun(
        "MT-NLG 530B", "Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B, Sec. 2-3",
        MT_NLG_530B, "dgx-a100-80gb", 280, 1920, 2048, {"dp": 8, "tp": 8, "pp": 35, "cp": 1}, 0.30,
        "60.1 s per iteration on 280 nodes: 1920 x 2048 tokens x (6 N + 12 L h s) FLOPs / (60.1 s x 2240 x 312 "
        "TFLOP/s) = 0.30 (the paper's 126 TFLOP/s per GPU count the recomputed forward)",
        pinned={"zero_stage": 1, "recompute": "full", "schedule": "1f1b"},
        space={"recomputes": ("full",), "zero_stages": (0, 1)},
        gaps="DeepSpeed's ZeRO-1 + Megatron's TP x PP; no sequence parallelism then (the planner assumes SP)"),
    PublishedRun(
        "BLOOM 176B", "BigScience, Le Scao et al. 2022, BLOOM: A 176B-Parameter Open-Access Multilingual Language "
        "Model, Sec. 3.4", BLOOM_176B, "dgx-a100-80gb", 48, 2048, 2048, {"dp": 8, "tp": 4, "pp": 12, "cp": 1}, 0.37,
        "156 TFLOP/s per GPU counting the recomputed forward (Megatron-DeepSpeed's formula, full activation "
        "checkpointing): x 3/4 = 0.37 of 312",
        pinned={"zero_stage": 1, "recompute": "full", "schedule": "1f1b"},
        space={"zero_stages": (0, 1), "recomputes": ("selective", "full")},
        gaps="70 blocks on 12 stages: DeepSpeed balanced by parameters (embedding counted as a layer), the planner "
             "uses ends_split; ALiBi and the embedding LayerNorm are not modelled"),
    PublishedRun(
        "OPT-175B", "Zhang et al. 2022, OPT: Open Pre-trained Transformer Language Models, Sec. 2.4",
        OPT_175B, "dgx-a100-80gb", 124, 992, 2048, {"dp": 124, "tp": 8, "pp": 1, "cp": 1}, 0.47,
        "up to 147 TFLOP/s per GPU, / 312", pinned={"zero_stage": 3}, space={"zero_stages": (1, 3)},
        gaps="FSDP (ZeRO-3) with Megatron TP 8 on 992 GPUs; the batch of ~2M tokens does not divide by DP 124: "
             "992 sequences here; 'up to' 147 TFLOP/s, its counting not stated"),
    PublishedRun(
        "Llama 3 405B, 8K", "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4 and Sec. 3.3.2",
        LLAMA3_405B, "dgx-h100", 2048, 2048, 8192, {"dp": 128, "tp": 8, "pp": 16, "cp": 1}, 0.41,
        "Table 4: 400 TFLOP/s per GPU, 41 % BF16 MFU on 16,384 GPUs", pinned={"zero_stage": 1},
        space={"zero_stages": (1,), "recomputes": ("selective", "full"), "micro_batches": (1,)},
        gaps="their interleaved schedule with a tunable number of micro-batches per group; 126 layers on 16 stages "
             "(7, 8, ..., 8, 7) as ends_split cuts them"),
    PublishedRun(
        "Llama 3 405B, 128K", "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4", LLAMA3_405B, "dgx-h100",
        2048, 128, 131072, {"dp": 8, "tp": 8, "pp": 16, "cp": 16}, 0.38,
        "Table 4: 380 TFLOP/s per GPU, 38 % BF16 MFU", pinned={"zero_stage": 1},
        space={"zero_stages": (1,), "recomputes": ("selective", "full"), "micro_batches": (1,)},
        gaps="their CP all-gathers K/V instead of a ring; document masks shorten attention (the planner assumes "
             "full causal attention over 128K)"),
    PublishedRun(
        "DeepSeek-V3", "DeepSeek-AI 2024, DeepSeek-V3 Technical Report, Sec. 3.2 and Table 1",
        DEEPSEEK_V3_LIKE, "hgx-h800", 256, 15360, 4096, {"dp": 128, "tp": 1, "pp": 16, "cp": 1, "ep": 64}, 0.36,
        "180K H800 GPU hours per trillion tokens: 1e12 / (180e3 x 3600 s) = 1543 tokens/s per GPU x ~2.33e11 "
        "FLOPs per token (6 x 37B active + causal attention) = 0.36 of 989 TFLOP/s", full_attention=False,
        pinned={"zero_stage": 1, "schedule": "zb_h1"}, space={"zero_stages": (1,), "micro_batches": (1,)},
        assume=Assumptions(ep_overlap=1.0, dense_layers=DEEPSEEK_V3_DENSE_LAYERS),
        gaps="MLA (modelled as MHA), multi-token prediction, FP8 GEMMs and DualPipe (priced as ZB-H1 with the "
             "all-to-all fully overlapped) are not modelled; the 3 dense leading blocks' activations are "
             "counted as MoE blocks'"),
]


AUTOMODEL_PRECISION = "bf16"
"""How NeMo AutoModel's benchmark recipes hold the model states (the YAML files of its repository's LLM benchmark
examples): the model built with ``from_config`` (its dtype "auto" is bf16), sharded by FSDP2, trained by
``torch.optim.Adam``, whose moments take the weights' dtype: 8 bytes per parameter, no fp32 master copy."""

AUTOMODEL_ZERO = (0, 3)
"""The data-parallel strategies NeMo AutoModel offers (its ``distributed.strategy``): DDP (ZeRO-0) and FSDP2 or
Megatron-FSDP (ZeRO-3); it has no ZeRO-1 or ZeRO-2, so the free plan of its runs searches these two, as
Megatron-LM's runs search its distributed optimizer (ZeRO-1) only."""

NVIDIA_RUNS: list[PublishedRun] = [
    PublishedRun(
        "Qwen3 30B-A3B", "NVIDIA NeMo AutoModel, Performance Summary (docs.nvidia.com/nemo/automodel), Pre-Training, "
        "System DGX-H100, BF16, row 'Qwen3 MoE 30B': 8 GPUs, GBS 512, MBS 4, GA 16, seq 4096, TP 1, PP 1, CP 1, "
        "EP 8, FSDP 8, 21.773 s per step, 277 model TFLOP/s and 12,040 tokens/s per GPU",
        QWEN3_30B_A3B, "dgx-h100", 1, 512, 4096, {"dp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": 8}, 0.28,
        "277 model TFLOP/s per GPU / 989 = 0.28; the table counts causal attention: 12,040 tokens/s x (6 x 3.04e9 "
        "active + 3 x 48 x 2 x 4096 x 4096) = 278 TFLOP/s with the real 128-wide heads (full attention would give 336)",
        full_attention=False, pinned={"zero_stage": 3, "micro_batch": 4, "recompute": "full"},
        space={"zero_stages": AUTOMODEL_ZERO},
        assume=Assumptions(precision=AUTOMODEL_PRECISION, ep_dedup=True),
        gaps="FSDP2 (ZeRO-3) over the 8 GPUs, EP 8 inside it, MBS 4 with full activation checkpointing as its "
             "recipe (AutoModel's Qwen3 MoE 30B benchmark with TE and DeepEP) sets them; the model states in "
             "bf16 (AUTOMODEL_PRECISION); DeepEP's kernels (on 20 SMs), the 128-wide heads and the recipe's "
             "balanced fake gate (no load imbalance, as the planner assumes) are not modelled beyond that"),

    PublishedRun(
        "Kimi K2", "NVIDIA NeMo AutoModel, Performance Summary (docs.nvidia.com/nemo/automodel), Pre-Training, "
        "System DGX-H100, BF16, row 'Kimi K2': 256 GPUs, GBS 512, MBS 1, LBS 8, GA 2, seq 4096, TP 1, PP 8, CP 1, "
        "EP 32, VP 4, FSDP 32, 8.86 s per step, 189 model TFLOP/s and 924 tokens/s per GPU",
        KIMI_K2, "dgx-h100", 32, 512, 4096, {"dp": 32, "tp": 1, "pp": 8, "cp": 1, "ep": 32}, 0.19,
        "189 model TFLOP/s per GPU / 989 = 0.19 (924 tokens/s x 6 x ~32.6e9 active parameters = 181 TFLOP/s: the "
        "rest is attention; how the table counts MLA's attention is not stated, assumed causal)",
        full_attention=False,
        pinned={"zero_stage": 3, "schedule": "interleaved", "v": 4, "micro_batch": 1, "recompute": "full"},
        space={"zero_stages": AUTOMODEL_ZERO, "micro_batches": (1,), "schedules": ("1f1b", "interleaved"),
               "virtual_stages": (2, 4)},
        assume=Assumptions(dense_layers=KIMI_K2_DENSE_LAYERS, precision=AUTOMODEL_PRECISION, ep_dedup=True),
        gaps="FSDP2 (ZeRO-3) x PP 8 (interleaved, 4 chunks per rank): the planner's ZeRO-3-with-a-pipeline, in "
             "torchtitan's form; full activation checkpointing and HybridEP's per-node de-duplication (ep_dedup) as "
             "its recipe (AutoModel's Kimi K2 benchmark with TE and HybridEP) sets them; model states in bf16 "
             "(AUTOMODEL_PRECISION: with fp32 master weights and moments the mesh would need more than the GPU, "
             "16 bytes for each parameter of the 12 experts per block that EP 32 = DP 32 leaves unsharded); the "
             "recipe's 2 blocks per virtual stage priced as ends_split's 61 blocks over 32 chunks; MLA is not "
             "modelled"),

]
"""Runs NVIDIA measured and published in its frameworks' performance tables (not a model's own report): the
mesh, batch and throughput as the table's row gives them."""


def published_runs() -> list[PublishedRun]:
    """Every run the planner is checked against: Megatron-LM's table first, then the papers' runs, then NVIDIA's
    performance tables."""
    return _megatron_runs() + OTHER_RUNS + NVIDIA_RUNS


@dataclass(frozen=True)
class PublishedCheck:
    """One published run against the planner: the planner's best with the published mesh pinned (when no
    setting of it fits the planner's memory model, the one that comes closest, priced all the same:
    ``pinned.fits`` is then False), and the 1-based place of the published mesh among the distinct meshes when
    left free (only what the study itself fixed stays fixed: DP 48 for Megatron-LM's weak scaling; None: not
    among them)."""

    run: PublishedRun
    pinned: Prediction
    free_place: int | None
    free: PlanResult | None

    @property
    def predicted_mfu(self) -> float:
        return self.pinned.mfu_full_attention if self.run.full_attention else self.pinned.mfu

    @property
    def gap(self) -> float:
        return self.predicted_mfu - self.run.mfu


def mesh_place(res: PlanResult, mesh: dict[str, int]) -> int | None:
    """Place of exactly ``mesh`` (degrees not given are 1) among the distinct meshes of ``res``."""
    return res.place(**{a: mesh.get(a, 1) for a in MESH_AXES})


def check(run: PublishedRun, free: bool = True) -> PublishedCheck:
    """Plan ``run`` pinned (its mesh and ``pinned`` settings) and, with ``free``, free (the same space,
    ``study_fixed`` only; the slow part on thousands of GPUs)."""
    cl = cluster(run.cluster, run.nodes)
    fixed = {"ep": 1} | run.mesh | run.pinned
    res = plan(run.cfg, cl, run.global_batch, run.seq_len, assume=run.assume, fixed=fixed, **run.space)
    pinned = res.ranked[0] if res.ranked else _closest(run, cl, fixed)
    if not free:
        return PublishedCheck(run, pinned, None, None)
    res = plan(run.cfg, cl, run.global_batch, run.seq_len, assume=run.assume, fixed=run.study_fixed, **run.space)
    return PublishedCheck(run, pinned, mesh_place(res, {"ep": 1} | run.mesh), res)


def _closest(run: PublishedRun, cl: Cluster, fixed: dict[str, object]) -> Prediction:
    """The published mesh's setting that needs the least memory, priced although it does not fit."""
    space = dict(run.space) | {"gpus_per_node": cl.gpus_per_node}
    preds = [predict(run.cfg, cl, run.global_batch, run.seq_len, c, run.assume)
             for c in candidates(run.cfg, cl.world_size, run.global_batch, run.seq_len, fixed=fixed, **space)]
    return min(preds, key=lambda p: p.memory.total)


def check_megatron() -> list[PublishedCheck]:
    """Every row of ``MEGATRON_WEAK_SCALING`` checked (sequence 4096, ``MEGATRON_SPACE``, ``TP_OVERLAP``)."""
    return [check(r) for r in _megatron_runs()]
