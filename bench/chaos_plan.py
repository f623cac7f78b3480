"""The chaos soak's plan: which actor dies (``KINDS``), at which moment of a step (``MOMENTS``, and
``RESTORE``: a second fault during a recovery), drawn from a seed, at most one fault a step."""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("rollout", "reward", "filter", "learner")
MOMENTS = ("start", "random", "sync", "checkpoint", "ahead")
RESTORE = "restore"  # a learner rank of the group being restored after a learner fault
CHECKPOINT_EVERY = 3


@dataclass
class Fault:
    step: int
    kind: str  # one of KINDS, or "sigterm"
    moment: str  # one of MOMENTS ("start" for sigterm)
    delay_s: float = 0.0  # "random": seconds after the step's start
    rank: int = 0  # "learner": which rank is killed
    t: float | None = None  # when it was delivered (monotonic)
    segment: int | None = None  # 0: before the SIGTERM, 1: the resumed process
    note: str = ""


def checkpoint_step(step: int) -> bool:
    """A checkpoint is written after ``step`` (the one at ``step + 1``)."""
    return (step + 1) % CHECKPOINT_EVERY == 0


def has_ahead(step: int, steps: int) -> bool:
    """``step``'s update runs with the next step's rollouts in flight (lag 1, no checkpoint
    between them, not the last step)."""
    return step + 1 < steps and not checkpoint_step(step)


def plan_faults(seed: int, steps: int, n: int, restore: bool = True) -> list[Fault]:
    """``n`` faults and one SIGTERM on distinct steps of ``1 .. steps - 3``; every kind and
    every moment at least once where ``n`` allows (a checkpoint moment on a checkpoint step, an
    ahead moment on a step with rollouts ahead). ``restore``: one more, a learner rank killed
    during the restore that the first learner fault causes (it shares that fault's step)."""
    rng = random.Random(seed)
    usable = list(range(1, steps - 2))
    if n + 1 > len(usable):
        raise ValueError(f"{n} faults and a SIGTERM need {n + 1} steps in 1..{steps - 3}")
    sigterm = usable[len(usable) // 2 + rng.randrange(-1, 2)]
    free = [s for s in usable if s != sigterm]
    combos = [(k, m) for m in MOMENTS for k in KINDS]
    rng.shuffle(combos)
    # the first picks cover every moment (learner at the checkpoint and the sync first: the
    # hardest) and every kind, the rest are drawn freely
    wanted = [
        ("learner", "checkpoint"),
        ("learner", "sync"),
        ("rollout", "ahead"),
        ("reward", "random"),
        ("filter", "start"),
    ]
    picks = wanted[:n] + [rng.choice(combos) for _ in range(max(n - len(wanted), 0))]
    faults = []
    for kind, moment in picks:
        if moment == "checkpoint":
            cands = [s for s in free if checkpoint_step(s)]
        elif moment == "ahead":
            cands = [s for s in free if has_ahead(s, steps)]
        else:
            cands = list(free)
        if not cands:
            moment, cands = "start", list(free)
        s = rng.choice(cands)
        free.remove(s)
        faults.append(Fault(s, kind, moment, delay_s=rng.uniform(0.0, 0.3), rank=rng.randrange(2)))
    faults.append(Fault(sigterm, "sigterm", "start"))
    learner = sorted(f.step for f in faults if f.kind == "learner")
    if restore and learner:
        faults.append(Fault(learner[0], "learner", RESTORE, rank=rng.randrange(2)))
    return sorted(faults, key=lambda f: f.step)
