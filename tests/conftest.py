"""Shared fixtures: a function "defined in a notebook cell", and a check that tests leave no process behind; and the
lanes `make test` runs the tests in (the Makefile's test targets):

* the parallel lane: ``pytest -n 2 --dist loadscope`` (pytest-xdist, a worker per core). Each test module stays on
  one worker (its module-scoped launches are cached there), except the modules in ``SPREAD``, whose tests are
  spread one by one (``pytest_xdist_make_scheduler`` below).
* the serial lane: the tests marked ``serial`` (timing-sensitive: hang reports, stragglers, grading time limits,
  launcher faults and kills under load), in one process beside the parallel lane, whose load they must stand.
  Whole modules are serial when named in ``SERIAL``; single tests carry ``@pytest.mark.serial``.
"""

from __future__ import annotations

import fnmatch
import functools
import linecache
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import psutil
import pytest


def define_in_cell(source: str, cell: str = "/tmp/ipykernel_0/cell_1.py") -> dict:
    """Execute ``source`` the way IPython runs a notebook cell: module ``__main__``, a file name that does not
    exist on disk, and the source registered in linecache. Returns the cell's namespace."""
    source = textwrap.dedent(source)
    lines = source.splitlines(keepends=True)
    linecache.cache[cell] = (len(source), None, lines, cell)
    namespace = {"__name__": "__main__"}
    exec(compile(source, cell, "exec"), namespace)
    return namespace


def venv_of_this_environment(where: Path) -> Path:
    """A virtual environment at ``where`` (its own ``sys.prefix``, so its own config folders) that imports this
    environment's packages through a ``.pth`` file; returns its python. Seconds, no download."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    Path(site, "course_env.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return python


def _rank_processes() -> set[int]:
    """Children of this process that are not multiprocessing's long-lived helpers (forkserver, tracker)."""
    helpers = ("forkserver", "resource_tracker")
    kids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if not any(h in " ".join(p.cmdline()) for h in helpers):
                kids.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return kids


@pytest.fixture
def no_leftover_ranks():
    """Fails the test if rank processes survive it."""
    yield
    left = _rank_processes()
    assert not left, f"rank processes left running: {left}"


@pytest.fixture(scope="module")
def one_torch_thread():
    """Single-process training beside rank processes on 2 cores: one torch thread (OpenMP's spinning threads
    compete with the ranks and make a 0.1 s run take 10 s under load)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_sessionfinish(session, exitstatus):
    """Write the session's end to ``$COURSE_PYTEST_DONE`` (the Makefile checks it): a test that ends the process
    itself (``os._exit`` in imported code) would otherwise end a run early with exit status 0 and no summary.
    Under pytest-xdist only the controller writes it: a worker that a test ended is reported by the controller as a
    crashed worker (a failure), and a worker's own end says nothing about the run's."""
    done = os.environ.get("COURSE_PYTEST_DONE")
    if done and not hasattr(session.config, "workerinput"):
        Path(done).write_text(f"{session.testscollected} collected, exit status {int(exitstatus)}\n")


SERIAL = ("test_launch_under_load.py", "test_launch_faults.py", "test_stragglers.py", "test_grading_isolation.py",
          "test_debug*.py")
"""Modules whose every test is timing-sensitive (``serial``): kills and faults of the launcher, under load too;
straggler detection; isolated grading with its time and memory limits (one class graded for the module); chapter
11's hang reports."""
SPREAD = ("test_grading.py", "test_grading_cases.py")
"""Modules whose tests the parallel lane spreads over its workers one by one, first: no module-scoped state, and
tests long enough (a graded notebook, an exercise's checks on ranks) that one worker holding them all would hold up
the run."""


GENERIC_KERNELS = {
    # each axis: its parity with the single-process baseline at its smallest world (every variant of that one
    # launch: optimizer, mode, stage, layout), and its bitwise or noise-scaled agreement with PyTorch's own API
    "dp": ["test_dp.py::test_parity_with_the_single_process_baseline[dp2-*]",
           "test_dp.py::test_parity_with_torch_distributed_data_parallel[dp2-*]",
           "test_dp.py::test_gradient_accumulation_with_no_sync[dp2-*]",
           "test_train.py::test_naive_data_parallel_matches_the_baseline_and_a_missing_division_is_caught[2]"],
    "zero": ["test_zero.py::test_parity_with_the_single_process_baseline_adamw[*-2]",
             "test_zero.py::test_parity_with_sgd_which_exposes_a_missing_average[2-*]",
             "test_zero.py::test_zero3_matches_fsdp2_and_the_baseline[2]"],
    "fsdp2": ["test_zero_fsdp2.py::test_per_parameter_sharding_matches_the_baseline_and_fully_shard[*-2]",
              "test_zero_fsdp2.py::test_sharded_optimizer_matches_the_baseline_and_partitions_the_state[*-2]"],
    "tp": ["test_tp.py::test_gpt_parity_with_one_process[tp2-*]", "test_tp.py::test_gpt_parity_swiglu_adamw[tp2]",
           "test_tp.py::test_dtensor_matches_one_process_and_ours[tp2-*]"],
    "cp": ["test_cp.py::test_whole_model_parity[*-2]", "test_cp.py::test_dp_x_cp_parity_and_gradient_group"],
    "ep": ["test_ep.py::test_parity_with_the_single_process_moe[*-2]", "test_ep.py::test_parity_ep_times_dp[*]",
           "test_moe_mesh.py::test_moe_with_capacity_and_router_losses_matches_one_process[*]"],
    "pp": ["test_pp.py::test_every_schedule_matches_the_baseline[2-*]",
           "test_pp.py::test_every_schedule_equals_one_process_accumulating_the_same_micro_batches_bit_for_bit[2-*]",
           "test_pp.py::test_torch_pipelining_on_the_same_stages_gives_the_same_bits[2-*]",
           "test_pp.py::test_an_uneven_split_matches_the_baseline_and_torch[*]"],
    "contract": ["test_contract.py::test_data_parallel_forms_match_the_baseline_with_and_without_no_sync[*-2]",
                 "test_contract.py::test_model_parallel_forms_match_the_baseline_through_the_one_loop[*-2]"],
    # each composition: every mesh of each composing module's launch (2 and 4 ranks; the 8-rank meshes compose the
    # same steps again), HSDP, the reduction rule, resuming on another mesh
    "compositions": ["test_compose.py::test_composed_mesh_matches_one_process_at_2_ranks[*]",
                     "test_compose.py::test_composed_mesh_matches_one_process_at_4_ranks[*]",
                     "test_compose_pairs.py::test_pair_matches_one_process_at_4_ranks[*]",
                     "test_compose_ep.py::test_expert_parallel_mesh_matches_one_process_at_4_ranks[*]",
                     "test_compose_fsdp_pp.py::test_fsdp_x_pp_matches_one_process_at_4_ranks[*]",
                     "test_tp_cp_bytes.py::test_tp_x_cp_with_gqa_matches_one_process[*]",
                     "test_dp_reduce.py::test_the_rule_matches_one_process[*]",
                     "test_dp_reduce.py::test_fsdp_with_replicated_parameters_matches_one_process[*]",
                     "test_moe_local.py::test_local_capacity_matches_its_reference_and_its_mutations_do_not[*]",
                     "test_hsdp.py::test_hsdp_matches_the_baseline_and_its_replicas_agree",
                     "test_checkpoint_meshes.py::test_resumed_on_another_mesh_equals_the_uninterrupted_run[*]"],
    # every tolerance stated from a noise measured on one machine (a multiple of another run's, an rtol/atol on
    # kernel outputs, an exact equality of two kernel paths): these are what another CPU's roundings would break
    "tolerances": ["test_hsdp.py::test_hsdp_in_bf16_matches_the_baseline_within_the_bf16_noise",
                   "test_zero.py::test_mixed_precision_bf16_compute_with_fp32_master_shards[*]",
                   "test_moe_local.py::test_on_one_process_local_is_global_bit_for_bit",
                   "test_moe_local.py::test_the_balance_loss_is_megatrons_per_data_rank_micro_batch",
                   "test_model.py::test_shared_expert_is_added_once_unweighted",
                   "test_model.py::test_a_future_token_never_changes_earlier_logits[*]",
                   "test_model.py::test_shorter_sequences_and_the_pipeline_pieces",
                   "test_model.py::test_gqa_equals_mha_whose_kv_heads_are_repeated[*]",
                   "test_model.py::test_moe_with_every_expert_is_the_softmax_weighted_sum",
                   "test_model.py::test_moe_top_k_routing_by_hand[*]",
                   "test_model.py::test_swiglu_mlp_and_rmsnorm_by_hand",
                   "test_ep.py::test_aux_and_z_loss_by_hand_and_their_gradient_reaches_the_router",
                   "test_ep.py::test_aux_loss_is_exactly_alpha_for_uniform_routing[*]",
                   "test_pp.py::test_a_weight_used_twice_in_a_stage_gets_its_gradient_once",
                   "test_tp.py::test_grad_norm_clipping_counts_each_shard_once[tp2]",
                   "test_serving.py::test_engine_logits_match_the_model_forward_within_fp32_tolerance",
                   "test_serving_grading.py::test_the_paged_decode_reference_reads_what_the_librarys_paged_cache_wrote",
                   "test_collectives.py::test_matches_torch_and_sends_the_formula_bytes[*-world2]"],
}
"""``generic_kernels``: what ``make test-parity-generic`` runs again on PyTorch's generic CPU kernels. The rule
(pyproject.toml's marker says it too): each axis, each composition, every test whose tolerance was derived from a
noise measured on one machine. The parity rule itself (``course_lib.train.compare``) measures its noise on the
kernels it runs on, so one launch per axis and per composition shows that its multiple holds on other roundings;
the 4-rank and 8-rank repeats of an axis, its mutations (they must fail by far more than any rounding) and the
resumes of the same runs add nothing there. Patterns are ``file::test[ids]`` in fnmatch's syntax under tests/."""
FAST = [
    "test_dp.py::test_parity_with_the_single_process_baseline[dp2-overlapped-sgd]",
    "test_zero.py::test_parity_with_the_single_process_baseline_adamw[3-2]",
    "test_zero_fsdp2.py::test_per_parameter_sharding_matches_the_baseline_and_fully_shard[run0-tc0-2]",
    "test_tp.py::test_gpt_parity_with_one_process[tp2-sgd_sp]",
    "test_cp.py::test_whole_model_parity[sgd_zigzag-cfg0-tc0-2]",
    "test_ep.py::test_parity_with_the_single_process_moe[top2-2]",
    "test_pp.py::test_every_schedule_matches_the_baseline[2-1f1b]",
    "test_compose.py::test_composed_mesh_matches_one_process_at_2_ranks[cp2]",
]
"""``fast``: the one parity test per axis (and one composition) that ``make test-fast`` keeps, at 2 ranks; the
grading tests mark their own (chapter 00's graded solution)."""


@functools.cache
def _regex(*patterns: str) -> re.Pattern:
    """``patterns``' ``*`` and ``?`` are wildcards, their brackets a test's parameters (not fnmatch's sets)."""
    literals = ("tests/" + "".join({"[": "[[]", "]": "[]]"}.get(c, c) for c in p) for p in patterns)
    return re.compile("|".join(fnmatch.translate(literal) for literal in literals))


def _matches(nodeid: str, pattern: str) -> bool:
    return _regex(pattern).match(nodeid) is not None


def _selected(nodeid: str, patterns: list[str]) -> bool:
    return _regex(*patterns).match(nodeid) is not None


def _check_patterns(config, items, tables: dict[str, list[str]]) -> None:
    """A pattern of ``tables`` that selects nothing in a module this run collected whole names a renamed or removed
    test: refused, so that the lanes never lose a test silently."""
    if config.option.keyword or any("::" in arg for arg in config.args):
        return  # part of a module collected: nothing to tell
    modules: dict[str, list[str]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item.nodeid)
    for table, patterns in tables.items():
        for pattern in patterns:
            module = "tests/" + pattern.split("::")[0]
            if module in modules and not any(_matches(nodeid, pattern) for nodeid in modules[module]):
                raise pytest.UsageError(f"tests/conftest.py {table}: {pattern!r} selects no test of {module}")


def _spread(nodeid: str) -> bool:
    return Path(nodeid.split("::")[0]).name in SPREAD


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the serial modules' tests ``serial``, and the tests of ``GENERIC_KERNELS`` and ``FAST`` (before ``-m``
    selects); put the ``SPREAD`` modules' tests first
    (the parallel lane hands out work in this order); ship test functions to ranks by value (as a notebook's are),
    so each rank does not re-import the test module and pytest with it (~0.3 s per rank per launch)."""
    import cloudpickle

    generic = [p for patterns in GENERIC_KERNELS.values() for p in patterns]
    _check_patterns(config, items, {"GENERIC_KERNELS": generic, "FAST": FAST})
    for item in items:
        if any(fnmatch.fnmatch(item.path.name, pattern) for pattern in SERIAL):
            item.add_marker(pytest.mark.serial)
        if _selected(item.nodeid, generic):
            item.add_marker(pytest.mark.generic_kernels)
        if _selected(item.nodeid, FAST):
            item.add_marker(pytest.mark.fast)
    items.sort(key=lambda item: not _spread(item.nodeid))  # stable: the rest keep their order
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        cloudpickle.register_pickle_by_value(module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` (the parallel lane's) with these units of work: a test module (its cached launches stay
    on one worker), or a single test of a ``SPREAD`` module; handed out in collection order."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if _spread(nodeid) else nodeid.split("::")[0]

    config.option.loadscopereorder = False
    return ModuleScheduling(config, log)
