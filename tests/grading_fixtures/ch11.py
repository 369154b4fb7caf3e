"""Wrong answers for chapter 11 (debugging distributed runs): each is a plausible mistake, and each must be refused
with its reason (``tests/test_grading.py`` runs them all; ``tests/test_exercise_reasons.py`` checks the reasons
of the ones the issue names: the victim named instead of the culprit, noise called a bug)."""

import functools
from collections import Counter

import torch

from course_lib import comm
from course_lib.data import global_batch, shard
from course_lib.debug import clinic
from course_lib.debug.checksums import BEFORE_TRAINING
from course_lib.debug.clinic import Diagnosis
from course_lib.debug.watch import Instruments
from course_lib.grading import ch11
from course_lib.model import GPT, lm_loss
from course_lib.parallel import compose
from course_lib.parallel.dp import DataParallel
from course_lib.parallel.pp_executor import PipelineExecutor

# ------------------------------------------------------------------------------------------- first_desync


def _desync(calls, finished, *, grouped=True, tie_break=True, keys=("op", "shapes", "dtype", "site"),
            late_is_missing=False, last=False, victims=False):
    """A comparison with switches, each switch one mistake."""
    def sig(c):
        return None if c is None else repr(tuple(c[k] for k in keys))
    groups = {}
    for rank, mine in calls.items():
        for i, c in enumerate(mine):
            key = (c["group"], tuple(c["ranks"])) if grouped else ("all", tuple(sorted(calls)))
            groups.setdefault(key, {}).setdefault(rank, {})[c["n"] if grouped else i + 1] = c
    found = []
    for key, members in groups.items():
        ranks = [r for r in key[1] if r in calls]
        top = max((n for r in ranks for n in members.get(r, {})), default=0)
        for n in range(1, top + 1):
            here = {r: members.get(r, {}).get(n) for r in ranks}
            here = {r: c for r, c in here.items() if c is not None or late_is_missing or r in finished}
            if len({sig(c) for c in here.values()}) > 1:
                found.append((min(c["t"] for c in here.values() if c), key, n, here))
                break
    if not found:
        return None
    _, key, n, here = max(found) if last else min(found)
    votes = Counter(sig(c) for c in here.values())
    (best, count), *rest = votes.most_common()
    right = best if not rest or count > rest[0][1] else None
    if right is None and tie_break:
        for (label, rs), members in groups.items():
            there = [m.get(n) for m in members.values()]
            if label == key[0] and rs != key[1] and len(there) == len(rs) and None not in there \
                    and len({sig(c) for c in there}) == 1 and sig(there[0]) in votes:
                right = sig(there[0])
    if right is None and None in votes:
        right = next(s for s in votes if s is not None)
    wrong = sorted(r for r, c in here.items() if right is None or sig(c) != right)
    culprits = sorted(set(here) - set(wrong)) if victims and right is not None else wrong
    label = next(c for c in here.values() if c)["group"] if not grouped else key[0]
    ranks = next(c for c in here.values() if c)["ranks"] if not grouped else list(key[1])
    n = next(c for c in here.values() if c)["n"] if not grouped else n
    return {"group": label, "ranks": list(ranks), "n": n, "culprits": culprits}


def desync_in_global_order(calls, finished):
    """Each rank's calls compared position by position in the rank's own order, whatever their group."""
    return _desync(calls, finished, grouped=False)


def desync_names_the_victims(calls, finished):
    """The ranks that called what the majority called."""
    return _desync(calls, finished, victims=True)


def desync_without_tie_break(calls, finished):
    """On a tie every member is named, though the other tp groups say which call is right."""
    return _desync(calls, finished, tie_break=False)


def desync_by_op_only(calls, finished):
    """Only the op compared: two same-sized all-reduces from two different lines go unseen."""
    return _desync(calls, finished, keys=("op",))


def desync_late_is_missing(calls, finished):
    """A rank that has not reached a call yet counted as one that skipped it."""
    return _desync(calls, finished, late_is_missing=True)


def desync_last(calls, finished):
    """The last disagreement (by start time) instead of the first."""
    return _desync(calls, finished, last=True)


# ------------------------------------------------------------------------------------------------ diagnose


def _triage(suspect, *, victims=False, noise_is_bug=False, step_shift=0, replace_all=False, wrong_part=False,
            classes=None):
    """The solution's triage with switches, each switch one mistake."""
    everyone = tuple(range(suspect.shape.world_size))
    w = suspect.run()
    if w.hang is not None:
        d = w.hang.desync
        call = d.calls[d.culprits[0]]
        ranks = tuple(r for r in everyone if r not in d.culprits) if victims else d.culprits
        return Diagnosis(clinic.HANG, ranks, call.step, f"{call.op} on {call.group}"), {
            "data_parallel": functools.partial(clinic.snapshot_step, after=call.step)}
    w = suspect.run(instruments=Instruments(checksums=suspect.shape, nonfinite=True))
    sampler = clinic.Sampler(suspect.tc.global_batch, clinic.CFG.seq_len, suspect.tc.seed)
    alarm = w.checksum_alarm()
    if alarm is not None and alarm.step == BEFORE_TRAINING:
        first = alarm.mismatches[0]
        ranks = tuple(r for r in everyone if r not in first.odd) if victims else first.odd
        fix = {"data_parallel": DataParallel}
        if replace_all:
            fix = {"data_parallel": DataParallel, "model_fn": None, "sampler": None}
        if wrong_part:
            fix = {"sampler": sampler}
        bug = (classes or {}).get("before training", clinic.NO_BROADCAST)
        return Diagnosis(bug, ranks, alarm.step + step_shift, first.name), fix
    hits = [r.nonfinite for r in w.reports if r.nonfinite is not None]
    if hits:
        first = min(hits, key=lambda h: h.order)
        return Diagnosis(clinic.NON_FINITE, (first.rank,), first.step, first.module), {"sampler": sampler}
    if alarm is not None:
        first = alarm.mismatches[0]
        return Diagnosis(clinic.DROPOUT_RNG, first.odd, alarm.step, first.name), {"model_fn": clinic.dropout_model}
    verdict = suspect.drift(w)[2]
    if verdict.verdict == "noise" and not noise_is_bug:
        return Diagnosis(clinic.NO_BUG), {}
    if "executor" in suspect.parts:
        return Diagnosis(clinic.ACCUMULATION, everyone, verdict.first_step), {"executor": PipelineExecutor}
    return Diagnosis(clinic.WRONG_GROUP, everyone, verdict.first_step or 1), {"data_parallel": compose.data_parallel}


def diagnose_names_victims(suspect):
    """The ranks that only wait (a hang) or hold the majority's copy (a checksum) named as the culprits."""
    return _triage(suspect, victims=True)


def diagnose_noise_as_bug(suspect):
    """A bf16 run's distance from one process called a bug (the fp32 rule applied to bf16)."""
    return _triage(suspect, noise_is_bug=True)


def diagnose_step_off_by_one(suspect):
    """Steps counted from 1: a check before training named step 0."""
    return _triage(suspect, step_shift=1)


def diagnose_wrong_class(suspect):
    """Replicas that differ before training blamed on dropout's RNG."""
    return _triage(suspect, classes={"before training": clinic.DROPOUT_RNG})


def diagnose_replaces_everything(suspect):
    """Every part replaced by the library's: a fix that does not say what was broken."""
    return _triage(suspect, replace_all=True)


def diagnose_fixes_the_wrong_part(suspect):
    """The right diagnosis, but the sampler replaced instead of the data-parallel form."""
    return _triage(suspect, wrong_part=True)


# ------------------------------------------------------------------------------------------- train_clipped


def _clipped(rank, world_size, steps, seed, *, clip_before=True, clip=True, before_divide=False,
             norm_of_norms=False, broadcast=False, limit=ch11.CLIP):
    model = GPT(clinic.CFG, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)
    losses = []
    for step in range(steps):
        x, y = (shard(t, rank, world_size) for t in global_batch(step, 8, clinic.CFG.seq_len, seed))
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        if norm_of_norms:  # the local norms' squares summed over the ranks, then each rank clips its own
            sq = torch.stack([p.grad.norm() ** 2 for p in model.parameters()]).sum().reshape(1)
            comm.all_reduce(sq)
            scale = min(1.0, limit / float(sq.sqrt()))
            for p in model.parameters():
                p.grad.mul_(scale)
        elif clip and clip_before and not before_divide:
            torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
        for p in model.parameters():
            comm.all_reduce(p.grad)
        if clip and before_divide:
            torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
        for p in model.parameters():
            p.grad /= world_size
        if clip and not (clip_before or before_divide or norm_of_norms):
            torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
        optimizer.step()
        if broadcast:
            for p in model.parameters():
                comm.broadcast(p.detach(), 0)
        mean = loss.detach().clone()
        comm.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses, dict(model.named_parameters())


def clipped_as_shipped(rank, world_size, steps=4, seed=0):
    """The colleague's loop: each rank clips its own gradient before the all-reduce."""
    return _clipped(rank, world_size, steps, seed)


def clipped_not_at_all(rank, world_size, steps=4, seed=0):
    """The clipping removed: replicas agree, but the run is not the clipped one."""
    return _clipped(rank, world_size, steps, seed, clip=False)


def clipped_before_dividing(rank, world_size, steps=4, seed=0):
    """Clipped after the sum but before the division by N: the norm of N times the mean."""
    return _clipped(rank, world_size, steps, seed, clip_before=False, before_divide=True)


def clipped_by_the_norm_of_local_norms(rank, world_size, steps=4, seed=0):
    """sqrt of the sum of the ranks' squared local norms, before the reduction: not the mean gradient's norm."""
    return _clipped(rank, world_size, steps, seed, norm_of_norms=True)


def clipped_then_broadcast(rank, world_size, steps=4, seed=0):
    """The shipped loop, then rank 0's weights broadcast every step: extra communication, still not one process."""
    return _clipped(rank, world_size, steps, seed, broadcast=True)


def clipped_to_a_smaller_limit(rank, world_size, steps=4, seed=0):
    """Each rank clips its local gradient to CLIP / N, so the sum stays under CLIP: not the mean's clipping."""
    return _clipped(rank, world_size, steps, seed, limit=ch11.CLIP / world_size)


WRONG = {
    "first_desync": [desync_in_global_order, desync_names_the_victims, desync_without_tie_break, desync_by_op_only,
                     desync_late_is_missing, desync_last],
    "diagnose": [diagnose_names_victims, diagnose_noise_as_bug, diagnose_step_off_by_one, diagnose_wrong_class,
                 diagnose_replaces_everything, diagnose_fixes_the_wrong_part],
    "train_clipped": [clipped_as_shipped, clipped_not_at_all, clipped_before_dividing,
                      clipped_by_the_norm_of_local_norms, clipped_then_broadcast, clipped_to_a_smaller_limit],
}
