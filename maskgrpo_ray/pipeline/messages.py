"""Typed messages between the phases (and the Ray actors): chunk -> rollout -> scored ->
filtered -> train.

Shapes use the project vocabulary: ``B`` prompts, ``G`` samples per prompt, ``N = B*G``,
``L`` image tokens, ``S`` unmasking steps, ``P`` condition tokens, ``H x W`` pixels.
Groups are contiguous: sample ``n`` belongs to prompt ``n // G``.

It imports torch only (the rest of the pipeline builds on it). A rollout that stays in Ray's object store
(``data_plane.RolloutRefs``) travels in a :class:`ScoredBatch` as a :class:`RolloutView`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class Chunk:
    """A unit of rollout work: prompts (with their stream positions) and the chunk's seed."""

    index: int
    prompts: list[str]  # [b], b <= B
    positions: list[int]  # [b] positions in the prompt stream
    seed: int


@dataclass(frozen=True)
class FilterResult:
    """The filter's decision on ``B`` groups."""

    keep: torch.Tensor  # [B] bool, groups to train on
    invalid: torch.Tensor  # [B] bool, groups with a NaN/inf reward (skipped, not resampled)
    stds: torch.Tensor  # [B] group reward std


class RolloutView(Protocol):
    """What a :class:`ScoredBatch` and the driver read of a rollout they may not hold: the
    parts of :class:`RolloutBatch` that ``data_plane.RolloutRefs`` (the rollout left in the
    object store) mirrors."""

    @property
    def prompts(self) -> list[str]: ...  # [B]

    @property
    def prompt_indices(self) -> list[int]: ...  # [B]

    @property
    def group_size(self) -> int: ...  # G

    @property
    def num_samples(self) -> int: ...

    @property
    def policy_version(self) -> int: ...

    def group_slice(self, keep: torch.Tensor) -> Any: ...

    @staticmethod
    def concat(batches: list[Any]) -> Any: ...


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _rows(x: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if x is None else x[rows]


def _check_record(b: Any) -> None:
    """The likelihood record matches the estimator (shared by rollout and train batches)."""
    n, u = b.final_tokens.shape[0], b.old_logp.shape[1]
    if b.estimator == "trajectory":
        _check(
            b.unmask_step is not None and b.unmask_step.shape == b.final_tokens.shape,
            "unmask_step must match final_tokens [N, L] (trajectory estimator)",
        )
        _check(
            b.step_agreement is None or b.step_agreement.shape == (n, u),
            f"step_agreement must be [N={n}, S={u}] (critical step selection)",
        )
    elif b.estimator == "forward":
        _check(
            b.mask_seed is not None and b.mask_seed.shape == (n,),
            f"mask_seed must be [N={n}] (forward estimator)",
        )
        _check(
            b.mask_counts is not None and b.mask_counts.shape == (n, u),
            f"mask_counts must be [N={n}, K={u}] (forward estimator)",
        )
        _check(
            b.forward_reduction in ("mean", "sum"),
            f"forward_reduction must be 'mean' or 'sum', got {b.forward_reduction!r}",
        )
    else:
        _check(False, f"estimator must be 'trajectory' or 'forward', got {b.estimator!r}")


def tensor_nbytes(obj: Any) -> int:
    """Bytes of the tensors in a dataclass message's fields (what a hop moves, without the
    pickling's few hundred bytes of framing)."""
    return sum(
        v.numel() * v.element_size()
        for f in fields(obj)
        if isinstance(v := getattr(obj, f.name), torch.Tensor)
    )


@dataclass(frozen=True)
class RolloutBatch:
    """Groups of G samples per prompt with the recorded trajectory and cached old log-probs."""

    prompts: list[str]  # [B]
    prompt_indices: list[int]  # [B] position of each prompt in the prompt stream
    group_size: int  # G
    cond_ids: torch.Tensor  # [N, P] long, the policy's condition ids
    final_tokens: torch.Tensor  # [N, L] long, codebook tokens
    # [N, L] long, step that committed each position (-1 = given); None: forward estimator
    unmask_step: torch.Tensor | None
    old_logp: torch.Tensor  # [N, U] float32, log-prob of each likelihood unit (U = S or K)
    sampled: torch.Tensor | None  # [N, S, L] long, AR-style only
    images: torch.Tensor  # [N, H, W, 3] uint8
    policy_version: int
    transition: str  # "p1" | "p2" | "ar" (trajectory estimator)
    guidance_scale: float
    temperature: float
    likelihood_tau: torch.Tensor  # [U] float32, Gumbel tau_t a unit integrates (forward: 0)
    estimator: str = "trajectory"  # "trajectory" (units: steps) | "forward" (units: mask draws)
    mask_seed: torch.Tensor | None = None  # [N] long, forward: each sample's mask seed
    mask_counts: torch.Tensor | None = None  # [N, K] long, forward: tokens each draw masks
    forward_reduction: str = "mean"  # forward: "mean" | "sum" over the masked positions
    forward_coupling: str = "none"  # forward: "complementary": draws 2j, 2j+1 complementary
    # [N, S] float32, share of the L tokens where step t's prediction (committed tokens kept)
    # equals the final sample (train.unmasking_step_selection critical only)
    step_agreement: torch.Tensor | None = None

    def without_images(self) -> RolloutBatch:
        """The same rollout with ``images`` emptied to ``[N, 0, 0, 3]`` (what the driver needs:
        the images go from the rollout actor to the reward actor only)."""
        return replace(self, images=self.images[:, :0, :0])

    def with_images(self, images: torch.Tensor) -> RolloutBatch:
        """The rollout with its ``images [N, H, W, 3]`` put back."""
        return replace(self, images=images).validate()

    @property
    def num_samples(self) -> int:
        return self.final_tokens.shape[0]

    @property
    def num_steps(self) -> int:
        return self.old_logp.shape[1]

    def validate(self) -> RolloutBatch:
        _check_record(self)
        b, g = len(self.prompts), self.group_size
        n = b * g
        _check(len(self.prompt_indices) == b, "prompt_indices must have one entry per prompt")
        _check(
            self.final_tokens.shape[0] == n,
            f"final_tokens has {self.final_tokens.shape[0]} rows, expected B*G={n}",
        )
        _check(self.cond_ids.shape[0] == n, "cond_ids must be [N, P]")
        _check(
            self.old_logp.shape[0] == n,
            "old_logp must be [N, S]",
        )
        _check(
            self.likelihood_tau.shape == (self.old_logp.shape[1],),
            "likelihood_tau must be [S], one Gumbel temperature per unmasking step",
        )
        _check(
            self.images.dtype == torch.uint8
            and self.images.shape[0] == n
            and self.images.shape[-1] == 3,
            "images must be uint8 [N, H, W, 3]",
        )
        _check(
            (self.sampled is not None) == (self.transition == "ar"),
            "sampled is recorded iff transition == 'ar'",
        )
        _check(bool(torch.isfinite(self.old_logp).all()), "old_logp has non-finite values")
        return self

    def group_slice(self, keep: torch.Tensor) -> RolloutBatch:
        """Keep the groups where ``keep`` (bool ``[B]``) is True."""
        rows = keep.repeat_interleave(self.group_size)
        idx = keep.nonzero().squeeze(1).tolist()
        return replace(
            self,
            prompts=[self.prompts[i] for i in idx],
            prompt_indices=[self.prompt_indices[i] for i in idx],
            cond_ids=self.cond_ids[rows],
            final_tokens=self.final_tokens[rows],
            unmask_step=_rows(self.unmask_step, rows),
            old_logp=self.old_logp[rows],
            sampled=_rows(self.sampled, rows),
            images=self.images[rows],
            mask_seed=_rows(self.mask_seed, rows),
            mask_counts=_rows(self.mask_counts, rows),
            step_agreement=_rows(self.step_agreement, rows),
        )

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        first = batches[0]
        if len(batches) == 1:
            return first
        cat: dict[str, Any] = {}
        for f in fields(RolloutBatch):
            vals = [getattr(b, f.name) for b in batches]
            if f.name in ("prompts", "prompt_indices"):
                cat[f.name] = [x for v in vals for x in v]
            elif f.name == "policy_version":
                cat[f.name] = min(vals)
            elif f.name == "likelihood_tau":
                if any(not torch.equal(v, vals[0]) for v in vals):
                    raise ValueError(
                        "cannot concatenate rollouts made with different tau schedules"
                    )
                cat[f.name] = vals[0]
            elif f.name in ("estimator", "forward_reduction", "forward_coupling", "transition"):
                if any(v != vals[0] for v in vals):
                    raise ValueError(f"cannot concatenate rollouts with different {f.name}s")
                cat[f.name] = vals[0]
            elif isinstance(vals[0], torch.Tensor):
                cat[f.name] = torch.cat(vals)
            else:
                cat[f.name] = vals[0]
        return RolloutBatch(**cat)


def merge_reward_failures(*many: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Sum ``ScoredBatch.reward_failures`` counts (component -> kind -> samples)."""
    out: dict[str, dict[str, int]] = {}
    for failures in many:
        for name, kinds in failures.items():
            slot = out.setdefault(name, {})
            for kind, n in kinds.items():
                slot[kind] = slot.get(kind, 0) + int(n)
    return out


@dataclass(frozen=True)
class RewardResult:
    """What a reward actor sends back for a rollout: the scores only, never the rollout."""

    rewards: torch.Tensor  # [N] float32 (weighted total; NaN where a component lost a sample)
    reward_parts: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N]
    accuracy: torch.Tensor | None = None  # [N] 0/1 where the reward defines correctness
    # component -> kind ("raised" | "nonfinite" | "bad_shape") -> samples whose score was lost
    reward_failures: dict[str, dict[str, int]] = field(default_factory=dict)
    # per-sample figures of the images, name -> [N]: maskgrpo_ray.algo.diversity's (a group's mean is
    # its diversity) and maskgrpo_ray.runlog.monitors' image statistics (image/*)
    diversity: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class ScoredBatch:
    """A rollout with its rewards; NaN rewards mark failed scores (their groups are skipped).

    ``rollout`` is the rollout itself (one process) or, on Ray, a
    :class:`~maskgrpo_ray.pipeline.data_plane.RolloutRefs` (a :class:`RolloutView`): the driver's view
    of a rollout that stays in the object store (``data_plane.fetch_rollout`` brings its
    tensors when needed)."""

    rollout: RolloutBatch | RolloutView
    rewards: torch.Tensor  # [N] float32 (weighted total)
    reward_parts: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N]
    accuracy: torch.Tensor | None = None  # [N] 0/1 where the reward defines correctness
    # component -> kind ("raised" | "nonfinite" | "bad_shape") -> samples whose score was lost
    reward_failures: dict[str, dict[str, int]] = field(default_factory=dict)
    # per-sample figures of the images, name -> [N]: maskgrpo_ray.algo.diversity's (a group's mean is
    # its diversity) and maskgrpo_ray.runlog.monitors' image statistics (image/*)
    diversity: dict[str, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def join(rollout: RolloutBatch | RolloutView, result: RewardResult) -> ScoredBatch:
        """A rollout and its reward actor's result, checked against each other."""
        return ScoredBatch(
            rollout,
            result.rewards,
            result.reward_parts,
            result.accuracy,
            result.reward_failures,
            result.diversity,
        ).validate()

    @staticmethod
    def concat(parts: list[ScoredBatch]) -> ScoredBatch:
        """The parts one after another (rollouts of one kind: all in-process or all
        references); reward failure counts are summed."""
        rollouts = [p.rollout for p in parts]
        kind = type(rollouts[0])
        if any(type(r) is not kind for r in rollouts):
            raise TypeError("cannot concatenate in-process rollouts with object-store ones")
        acc = None
        if all(p.accuracy is not None for p in parts):
            acc = torch.cat([p.accuracy for p in parts])  # type: ignore[misc]
        return ScoredBatch(
            kind.concat(rollouts),  # type: ignore[arg-type]
            torch.cat([p.rewards for p in parts]),
            {k: torch.cat([p.reward_parts[k] for p in parts]) for k in parts[0].reward_parts},
            acc,
            merge_reward_failures(*(p.reward_failures for p in parts)),
            {
                k: torch.cat([p.diversity[k] for p in parts])
                for k in parts[0].diversity
                if all(k in p.diversity for p in parts)
            },
        )

    def groups(self, keep: torch.Tensor) -> ScoredBatch:
        """The groups where ``keep`` (bool ``[B]``); failure counts stay with the whole batch
        they describe (they are not carried over)."""
        rows = keep.repeat_interleave(self.rollout.group_size)
        return ScoredBatch(
            self.rollout.group_slice(keep),
            self.rewards[rows],
            {k: v[rows] for k, v in self.reward_parts.items()},
            None if self.accuracy is None else self.accuracy[rows],
            {},
            {k: v[rows] for k, v in self.diversity.items()},
        )

    def validate(self) -> ScoredBatch:
        n = self.rollout.num_samples
        _check(self.rewards.shape == (n,), f"rewards must be [N={n}]")
        for k, v in self.reward_parts.items():
            _check(v.shape == (n,), f"reward part {k!r} must be [N={n}]")
        for k, v in self.diversity.items():
            _check(v.shape == (n,), f"diversity figure {k!r} must be [N={n}]")
        return self


@dataclass(frozen=True)
class TrainBatch:
    """What the learner needs: the kept groups' trajectories and their advantages."""

    group_size: int  # G
    cond_ids: torch.Tensor  # [N, P] long
    final_tokens: torch.Tensor  # [N, L] long
    unmask_step: torch.Tensor | None  # [N, L] long (trajectory estimator)
    old_logp: torch.Tensor  # [N, U] float32, U = S unmasking steps or K mask draws
    sampled: torch.Tensor | None  # [N, S, L] long (AR-style only)
    advantages: torch.Tensor  # [N] float32
    transition: str
    guidance_scale: float
    temperature: float
    policy_version: int  # oldest policy version among the rollouts
    likelihood_tau: torch.Tensor  # [U] float32, Gumbel tau_t a unit integrates (forward: 0)
    estimator: str = "trajectory"
    mask_seed: torch.Tensor | None = None  # [N] long (forward estimator)
    mask_counts: torch.Tensor | None = None  # [N, K] long (forward estimator)
    forward_reduction: str = "mean"
    forward_coupling: str = "none"
    step_agreement: torch.Tensor | None = None  # [N, S] float32 (critical step selection)

    @property
    def num_samples(self) -> int:
        return self.final_tokens.shape[0]

    @staticmethod
    def from_rollout(rb: RolloutBatch, advantages: torch.Tensor) -> TrainBatch:
        """The learner's view of a rollout (every group) with the given advantages ``[N]``."""
        return TrainBatch(
            group_size=rb.group_size,
            cond_ids=rb.cond_ids,
            final_tokens=rb.final_tokens,
            unmask_step=rb.unmask_step,
            old_logp=rb.old_logp,
            sampled=rb.sampled,
            advantages=advantages,
            transition=rb.transition,
            guidance_scale=rb.guidance_scale,
            temperature=rb.temperature,
            policy_version=rb.policy_version,
            likelihood_tau=rb.likelihood_tau,
            estimator=rb.estimator,
            mask_seed=rb.mask_seed,
            mask_counts=rb.mask_counts,
            forward_reduction=rb.forward_reduction,
            forward_coupling=rb.forward_coupling,
            step_agreement=rb.step_agreement,
        ).validate()

    def validate(self) -> TrainBatch:
        _check_record(self)
        n = self.num_samples
        _check(self.advantages.shape == (n,), f"advantages must be [N={n}]")
        _check(bool(torch.isfinite(self.advantages).all()), "advantages must be finite")
        _check(self.old_logp.shape[0] == n, "old_logp must be [N, S]")
        _check(
            self.likelihood_tau.shape == (self.old_logp.shape[1],),
            "likelihood_tau must be [S], one Gumbel temperature per unmasking step",
        )
        return self

    PER_SAMPLE = (
        "cond_ids",
        "final_tokens",
        "unmask_step",
        "old_logp",
        "sampled",
        "advantages",
        "mask_seed",
        "mask_counts",
        "step_agreement",
    )  # the fields with one row per sample

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Samples ``start .. stop - 1`` (a learner rank's contiguous share)."""
        cut: dict[str, Any] = {}
        for k in self.PER_SAMPLE:
            v = getattr(self, k)
            cut[k] = None if v is None else v[start:stop]
        return replace(self, **cut)

    def shard(self, rank: int, world: int) -> TrainBatch:
        """Learner rank ``rank``'s share of ``world``: a contiguous, balanced range of samples
        (:func:`shard_bounds`). Samples, not whole groups: the advantages are already computed,
        so a group may span two ranks, and ``N`` samples spread over ``W`` ranks take
        ``ceil(N / W)`` samples' time, not ``ceil(B / W)`` groups'."""
        return self.rows(*shard_bounds(self.num_samples, rank, world))


def shard_bounds(num_samples: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s samples ``[start, stop)`` of ``num_samples`` over ``world`` ranks:
    contiguous, sizes differing by at most one."""
    return rank * num_samples // world, (rank + 1) * num_samples // world
