"""The step-signal probe: which unmasking steps carry the reward's signal, on the run's own
model, during the run (``train.step_signal_every_steps``), and in ``bench/step_signal.py``.

One measurement, three parts, each shared by the run and the bench:

* the probe batches (:class:`ProbeSpec`): ``K`` batches of ``P`` prompts from their own seeded
  prompt stream, each generated with its own seed and scored with the run's reward; the
  advantages as the run computes them, and the same shuffled within each group
  (:func:`probe_batches`). Nothing here touches the run's prompt stream, filter or RNG: the
  probe has its own streams, so a run with it learns the same weights as a run without;
* the per-step gradients (:func:`step_grams`): for each unmasking step ``t`` and batch ``k``,
  ``g_{k,t}`` of the clipped objective restricted to step ``t``'s pairs (the learner's own
  ``accumulate_gradients``), kept as the Gram matrix of the ``K`` gradients of each step. On
  Ray every learner rank takes its shard of each batch and the gradients are summed across
  ranks (``reduce``) before the Gram: the same numbers as one process, up to float rounding;
* the figures (:class:`StepSignal`, from ``algo.step_signal``): per step the mean cosine and
  its standard error, the shuffled floor's, and the gradient norms.

:class:`StepSignalProbe` runs it from the driver's loop and formats the row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from maskgrpo_ray.algo.step_signal import passing_steps, shuffle_within_groups, signal_of_grams
from maskgrpo_ray.loop.collect import chunk_seed
from maskgrpo_ray.pipeline.learner_loss import accumulate_gradients
from maskgrpo_ray.pipeline.messages import Chunk, ScoredBatch, TrainBatch
from maskgrpo_ray.pipeline.phases import make_train_batch
from maskgrpo_ray.pipeline.settings import AdvantageSettings, UpdateSettings
from maskgrpo_ray.prompts.loading import PromptStream

if TYPE_CHECKING:
    from maskgrpo_ray.config import Config
    from maskgrpo_ray.models.base import MaskedImagePolicy

log = logging.getLogger(__name__)

PROBE_ATTEMPT = 7_919  # the probe's chunk seeds: an "attempt" no step's re-sampling reaches


@dataclass(frozen=True)
class ProbeSpec:
    """Which probe batches a measurement takes: ``K`` batches of ``P`` prompts from a prompt
    stream of its own seed, batch ``k`` generated with ``rollout_seeds[k]``, the shuffled floor
    drawn from ``shuffle_seed``."""

    batches: int  # K
    prompts_per_batch: int  # P
    stream_seed: int
    rollout_seeds: tuple[int, ...]  # [K]
    shuffle_seed: int

    @staticmethod
    def of_run(run_seed: int, step: int, batches: int, prompts_per_batch: int) -> ProbeSpec:
        """The probe of driver step ``step`` of a run seeded ``run_seed``: seeds of its own,
        fresh at every probe (what ``bench/step_signal.py --probe-step`` reproduces)."""
        seeds = tuple(chunk_seed(run_seed, step, PROBE_ATTEMPT, k) for k in range(batches))
        return ProbeSpec(
            batches,
            prompts_per_batch,
            stream_seed=(run_seed * 1_000_003 + step) % 2**31,
            rollout_seeds=seeds,
            shuffle_seed=chunk_seed(run_seed, step, PROBE_ATTEMPT + 1, 0),
        )

    @staticmethod
    def bench(batches: int, prompts_per_batch: int) -> ProbeSpec:
        """``bench/step_signal.py``'s own batches (prompt stream 123, seeds 1000 + k,
        shuffle 7): the ones docs/algorithm.md's table was measured on."""
        return ProbeSpec(
            batches, prompts_per_batch, 123, tuple(1000 + k for k in range(batches)), 7
        )

    def chunks(self, prompts: Sequence[str]) -> list[Chunk]:
        """The ``K`` probe batches as rollout chunks (one chunk a batch)."""
        stream = PromptStream(prompts, self.stream_seed, True)
        out = []
        for k in range(self.batches):
            ps, pos = stream.take(self.prompts_per_batch)
            out.append(Chunk(k, ps, pos, self.rollout_seeds[k]))
        return out


def probe_batches(
    scored: Sequence[ScoredBatch], spec: ProbeSpec, advantage: AdvantageSettings
) -> tuple[list[TrainBatch], list[TrainBatch]]:
    """Each probe batch with the run's advantages (groups with a failed score dropped), and
    the same with the advantages shuffled within each group (one generator, batch by batch)."""
    g = torch.Generator().manual_seed(spec.shuffle_seed)
    real, shuffled = [], []
    for sc in scored:
        keep = torch.isfinite(sc.rewards.view(-1, sc.rollout.group_size)).all(1)
        tb = make_train_batch(sc, keep, advantage)
        assert isinstance(tb, TrainBatch), "a probe's rollouts come back whole"
        real.append(tb)
        adv = shuffle_within_groups(tb.advantages, tb.group_size, g)
        shuffled.append(replace(tb, advantages=adv))
    return real, shuffled


def step_grams(
    policy: MaskedImagePolicy,
    batches: Sequence[TrainBatch],
    num_steps: int,
    s: UpdateSettings,
    *,
    normalizers: Sequence[float] | None = None,
    reduce: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The Gram matrices of the ``K`` batches' per-step gradients: float64 ``[S, K, K]``.

    ``g_{k,t}`` is ``accumulate_gradients`` over batch ``k``'s pairs at step ``t`` (the run's
    clip, guards, autocast and micro-batch), divided by ``normalizers[k]`` (default: the
    batch's samples: the gradient of the mean). ``reduce`` sums a flattened gradient in place
    across learner ranks (each rank passes its shard; None: one process). The policy's
    gradients and train/eval mode are restored, so the next update starts as it would have.
    Memory: ``K`` flattened float32 gradients at a time."""
    params = [p for p in policy.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    training = policy.training
    out = torch.zeros(num_steps, len(batches), len(batches), dtype=torch.float64)
    try:
        policy.train()
        for t in range(num_steps):
            vecs = []
            for k, batch in enumerate(batches):
                for p in params:
                    p.grad = None
                accumulate_gradients(
                    policy,
                    batch,
                    train_steps=torch.tensor([t]),
                    micro_batch=s.micro_batch_pairs,
                    clip_low=s.clip_low,
                    clip_high=s.clip_high,
                    normalizer=None if normalizers is None else float(normalizers[k]),
                    guards=s.guards,
                    autocast=s.autocast,
                )
                v = torch.cat(
                    [
                        (p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                        for p in params
                    ]
                ).float()
                if reduce is not None:
                    reduce(v)
                vecs.append(v)
            V = torch.stack(vecs)  # [K, P]
            out[t] = (V @ V.T).double().cpu()
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
        policy.train(training)
    return out


@dataclass(frozen=True)
class StepSignal:
    """One measurement's figures, per unmasking step ``[S]``: the mean cosine between the
    probe batches' gradients and its standard error, the same with shuffled advantages (the
    floor), and the mean gradient norms."""

    cos: list[float]
    cos_se: list[float]
    floor: list[float]
    floor_se: list[float]
    norm: list[float]
    norm_floor: list[float]

    @staticmethod
    def of_grams(real: torch.Tensor, shuffled: torch.Tensor) -> StepSignal:
        r, f = signal_of_grams(real), signal_of_grams(shuffled)
        return StepSignal(r["cos"], r["cos_se"], f["cos"], f["cos_se"], r["norm"], f["norm"])

    def passing(self, margin: float) -> list[int]:
        """The steps standing ``margin`` standard errors above their floor."""
        return passing_steps(self.cos, self.cos_se, self.floor, self.floor_se, margin)

    def row(self, margin: float) -> dict[str, float]:
        """The metrics row's part: ``step_signal/<figure>/<t>`` per step (scalars, so every
        tracker takes them) and the count of steps above the floor."""
        width = len(str(len(self.cos) - 1))
        out: dict[str, float] = {}
        for name in ("cos", "cos_se", "floor", "floor_se", "norm", "norm_floor"):
            for t, v in enumerate(getattr(self, name)):
                out[f"step_signal/{name}/{t:0{width}d}"] = v
        out["step_signal/steps_above_floor"] = float(len(self.passing(margin)))
        return out


def rng_kept(policy: torch.nn.Module) -> Any:
    """A context that restores the global RNG states (the CPU's and the policy's CUDA device's)
    on exit: whatever the probe draws (a model with dropout), the run's own draws after it are
    the ones they would have been."""
    cuda = sorted({p.device.index or 0 for p in policy.parameters() if p.device.type == "cuda"})
    return torch.random.fork_rng(devices=cuda)


def measure(
    policy: MaskedImagePolicy,
    real: Sequence[TrainBatch],
    shuffled: Sequence[TrainBatch],
    s: UpdateSettings,
) -> StepSignal:
    """The measurement in one process (the local backend, the bench); the global RNG state is
    kept, so nothing after it draws differently."""
    num_steps = int(real[0].old_logp.shape[1])
    with rng_kept(policy):
        grams = step_grams(policy, real, num_steps, s), step_grams(policy, shuffled, num_steps, s)
    return StepSignal.of_grams(*grams)


@dataclass
class StepSignalProbe:
    """The driver's probe: every ``train.step_signal_every_steps`` driver steps (step 0
    included), before the step's update, the executor generates the probe batches and measures
    them on the weights that update starts from (``Executor.probe_rollouts``,
    ``Executor.step_signal``: on Ray the rollout actors generate, the learner ranks measure)."""

    cfg: Config
    ex: Any
    prompts: list[str]
    advantage: AdvantageSettings  # the run's, made once at the start (StepSettings.advantage)

    def due(self, step: int) -> bool:
        every = self.cfg.train.step_signal_every_steps
        return bool(every) and step % every == 0

    def run(self, step: int) -> dict[str, Any]:
        """The probe of ``step`` when due: its row (``{}`` when not)."""
        if not self.due(step):
            return {}
        t = self.cfg.train
        t0 = time.perf_counter()
        p = t.step_signal_prompts_per_batch or t.prompts_per_step
        spec = ProbeSpec.of_run(self.cfg.run.seed, step, t.step_signal_batches, p)
        scored = self.ex.probe_rollouts(spec.chunks(self.prompts))
        real, shuffled = probe_batches(scored, spec, self.advantage)
        signal, selected = self.ex.step_signal(real, shuffled)
        row: dict[str, Any] = signal.row(t.unmasking_step_auto_margin)
        if selected is not None:
            row["auto_steps"] = selected
            row["auto_steps_trained"] = float(len(selected))
        row["step_signal/seconds"] = time.perf_counter() - t0
        log.info(
            "step %d: step signal above the floor at unmasking steps %s%s (%.1f s)",
            step,
            signal.passing(t.unmasking_step_auto_margin),
            "" if selected is None else f"; auto trains {selected}",
            row["step_signal/seconds"],
        )
        return row
