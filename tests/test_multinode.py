"""Beyond one machine: examples/multinode_dp.py under torchrun as two "nodes" on this machine.

Two torchrun agents, each started as it would be on its own node (``--nnodes=2 --node-rank=0`` and ``1``, two
workers each), meet at one c10d rendezvous on a free local port and form a single 4-rank gloo job: data-parallel
training whose gradients cross the "node" boundary, checked by the script against the single-process baseline
(per-step losses and every parameter, fp32, within the noise-derived tolerance of ``course_lib.train.compare``).

Process hygiene: the agents run in their own sessions; torchrun starts its workers in sessions of their own
too, so killing an agent's process group would not reach them. The test therefore records every descendant of
each agent while it runs and, whatever happens (pass, failure, timeout), suspends the agents that are still
there (so they start no one new), records once more, kills all of them and waits until they are gone. The
whole run is bounded by ``TIMEOUT_S`` (and the rendezvous's join timeout by the same).

The fast tests load the script as a module and run ``main()`` with one in-process rank (no torchrun): the
verdict line and the exit code, for a matching and for a deliberately different reference.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "multinode_dp.py"
NNODES, NPROC_PER_NODE = 2, 2
TIMEOUT_S = 180  # the whole two-node run, start-up included (~25 s on an idle 2-core machine)
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(proc: psutil.Process) -> set[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        return set(proc.children(recursive=True))
    return set()


def _kill_all(procs: set[psutil.Process]) -> list[psutil.Process]:
    """SIGKILL every process in ``procs`` (psutil checks pid reuse), wait for them; return those still alive."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    _, alive = psutil.wait_procs(procs, timeout=10)
    return alive


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no output)"


@pytest.mark.slow
def test_two_torchrun_nodes_train_in_parity_with_one_process(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["OMP_NUM_THREADS"] = "1"
    logs = [tmp_path / f"node{n}.log" for n in range(NNODES)]
    agents: list[subprocess.Popen] = []
    family: dict[int, set[psutil.Process]] = {n: set() for n in range(NNODES)}  # agent n's workers
    start = time.monotonic()
    try:
        for node in range(NNODES):
            cmd = [sys.executable, "-m", "torch.distributed.run",
                   f"--nnodes={NNODES}", f"--nproc-per-node={NPROC_PER_NODE}", f"--node-rank={node}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=test{os.getpid()}",
                   # both agents live on 127.0.0.1, so say which one hosts the rendezvous store (on a real
                   # cluster torchrun infers it from the endpoint's host name); fail fast if a node never comes
                   f"--rdzv-conf=is_host={int(node == 0)},join_timeout={TIMEOUT_S}",
                   "--max-restarts=0", str(SCRIPT)]
            with open(logs[node], "w") as log:
                agents.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                               start_new_session=True))
        while any(a.poll() is None for a in agents):
            for node, a in enumerate(agents):
                family[node] |= _descendants(psutil.Process(a.pid)) if a.poll() is None else set()
            if time.monotonic() - start > TIMEOUT_S:
                pytest.fail(f"the two-node run did not finish within {TIMEOUT_S} s\n"
                            + "\n".join(f"--- node {n} ---\n{_tail(p)}" for n, p in enumerate(logs)))
            time.sleep(0.2)
    finally:  # freeze the agents (no new workers), take a last census, kill everyone
        live = [psutil.Process(a.pid) for a in agents if a.poll() is None]
        for agent in live:
            with contextlib.suppress(psutil.NoSuchProcess):
                agent.suspend()
        for node, a in enumerate(agents):
            if a.poll() is None:
                family[node] |= _descendants(psutil.Process(a.pid))
        left = _kill_all(set().union(*family.values(), live))
        for a in agents:
            a.wait(timeout=10)
        assert not left, f"processes survived the kill: {left}"
    elapsed = time.monotonic() - start

    out = [p.read_text(errors="replace") for p in logs]
    for node, a in enumerate(agents):
        assert a.returncode == 0, f"node {node} torchrun exited with {a.returncode}:\n{_tail(logs[node])}"
    # rank 0 lives on whichever agent the rendezvous made node 0 (--node-rank is only a hint for c10d)
    verdicts = [text for text in out if "parity " in text]
    assert len(verdicts) == 1, out
    report = verdicts[0]
    assert re.search(r"^PASS$", report, re.M), report
    assert "parity PASS" in report and "replicas identical on every rank: True" in report
    world = NNODES * NPROC_PER_NODE
    assert f"world size {world}," in report

    # the job really spanned both agents: 4 ranks, 2 per node, each a worker of the agent of its node
    ranks = re.findall(r"^rank (\d+): node (\d+), local rank (\d+), host \S+, pid (\d+)$", report, re.M)
    assert sorted(int(r) for r, *_ in ranks) == list(range(world))
    by_node: dict[int, set[int]] = {}
    locals_by_node: dict[int, set[int]] = {}
    for _, node, local, pid in ranks:
        by_node.setdefault(int(node), set()).add(int(pid))
        locals_by_node.setdefault(int(node), set()).add(int(local))
    assert sorted(by_node) == list(range(NNODES))
    assert all(local == set(range(NPROC_PER_NODE)) for local in locals_by_node.values()), locals_by_node
    agent_workers = [{p.pid for p in family[n]} for n in range(NNODES)]
    agent_of = {}  # node id given by the rendezvous -> index of the torchrun agent whose workers those ranks are
    for node, pids in by_node.items():
        assert len(pids) == NPROC_PER_NODE
        agent_of[node] = next((i for i, w in enumerate(agent_workers) if pids <= w), None)
    assert sorted(agent_of.values()) == list(range(NNODES)), (by_node, agent_workers)
    print(f"two-node torchrun run: {elapsed:.1f} s")


def _load_script():
    spec = importlib.util.spec_from_file_location("multinode_dp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("perturb, code, verdict", [(0.0, 0, "PASS"), (1e-3, 1, "FAIL")])
def test_the_script_prints_its_verdict_and_exits_non_zero_on_fail(monkeypatch, capsys, perturb, code, verdict):
    for k in LAUNCHER_ENV:
        monkeypatch.delenv(k, raising=False)
    script = _load_script()
    real_baseline = script.train_baseline

    def baseline(cfg, tc):  # a reference that differs from the run by `perturb` in one weight
        ref = real_baseline(cfg, tc)
        name = sorted(ref.params)[0]
        ref.params[name] = ref.params[name] + perturb
        return ref

    monkeypatch.setattr(script, "train_baseline", baseline)
    monkeypatch.setattr(sys, "argv", ["multinode_dp.py", "--world-size=1", "--steps=1"])
    assert script.main() == code
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == verdict
    assert "rank 0: node 0, local rank 0" in out
