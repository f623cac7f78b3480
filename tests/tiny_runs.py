"""Shared helpers for the tests that train: the tiny toy run's overrides and the crash harness.

A test lists what it needs on top (``tiny_toy(steps, prompts, *extra)``); what every short toy
run shares is written once here. ``crash_at_step`` makes the driver's step N raise
``KeyboardInterrupt`` (a preemption, a node loss, a crash) inside a ``with`` block.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# Every short toy run: a 20-step base (pre-trained in seconds, cached per test folder), 4
# unmasking steps, one evaluation sample per prompt.
TINY_BASE = "model.toy.pretrain_steps=20"
QUIET = "logging.progress_bar=false"
NO_GRIDS = "logging.sample_grid_every_steps=0"
# small CPU shares, so that a Ray run's actors fit 2 cores
RAY_SHARES = (
    "rollout.num_cpus_per_actor=0.25",
    "reward.num_cpus_per_actor=0.25",
    "learner.num_cpus_per_worker=0.25",
)
ONE_OF_EACH = ("rollout.num_actors=1", "learner.num_workers=1", *RAY_SHARES)
# the algorithm tests' sampler: a 30-step base, 4 unmasking steps, groups of 3
TOY_G3 = [
    "model.toy.pretrain_steps=30",
    "rollout.unmasking_steps=4",
    "rollout.samples_per_prompt=3",
]


def tiny_toy(
    steps: int | None,
    prompts: int | None,
    *extra: str,
    warmup: bool = True,
    quiet: bool = True,
) -> list[str]:
    """The tiny toy run's ``--set`` overrides: ``train.steps`` (None: the config's),
    ``train.prompts_per_step`` (None: the config's), then ``extra`` (a later override of the
    same key wins). ``warmup``: the filter's warm-up is 2 groups; ``quiet``: no progress bar."""
    out = [TINY_BASE]
    if steps is not None:
        out.append(f"train.steps={steps}")
    if prompts is not None:
        out.append(f"train.prompts_per_step={prompts}")
    out += ["rollout.unmasking_steps=4", "eval.samples_per_prompt=1"]
    if warmup:
        out.append("filter.warmup_groups=2")
    if quiet:
        out.append(QUIET)
    return [*out, *extra]


def sets(overrides: Iterable[str]) -> list[str]:
    """``--set X`` for each override (the command line's form)."""
    return [a for s in overrides for a in ("--set", s)]


def train_argv(run: Path, overrides: Iterable[str], backend: str = "local") -> list[str]:
    """``maskgrpo train``'s arguments for a run in ``run`` with ``overrides``."""
    return ["train", "--backend", backend, "--run-dir", str(run), *sets(overrides)]


@contextmanager
def crash_at_step(
    monkeypatch: pytest.MonkeyPatch, crash_step: int, why: str = "simulated preemption"
) -> Iterator[None]:
    """Inside the block, the driver's step ``crash_step`` raises ``KeyboardInterrupt(why)``
    before it runs (the steps before it run as usual); after it, the real step is back."""
    from maskgrpo_ray.loop import driver

    real = driver.run_step
    where = inspect.signature(real)

    def crashing(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        if where.bind(*args, **kw).arguments["step"] == crash_step:
            raise KeyboardInterrupt(why)
        return real(*args, **kw)

    monkeypatch.setattr(driver, "run_step", crashing)
    try:
        yield
    finally:
        monkeypatch.setattr(driver, "run_step", real)
