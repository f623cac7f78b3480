"""Why a seed fails, measured per step (issue 53 item 1; docs/monitors.md, Diagnostics).

* :func:`group_figures` (every run, on the driver: the kept groups' rewards and advantages):
  the share of groups whose reward barely varies and the size of the advantages they get
  (Eq. 12 divides by the group's std: a near-constant group's noise becomes unit advantages).
* :func:`update_size` and :func:`half_batch_cosine` (``logging.diagnostics``, the local
  backend): the update's size against the learning rate, ``||delta theta|| / lr``, and the
  gradient noise, the cosine between the gradients of two halves of the step's groups
  (independent prompts): near 0, the update is mostly noise.
"""

from __future__ import annotations

import math

import torch

from maskgrpo_ray.models.base import MaskedImagePolicy
from maskgrpo_ray.pipeline.learner_loss import accumulate_gradients
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.pipeline.settings import UpdateSettings

NEAR_ZERO = 0.1  # a group is near-constant when its reward std is below this share of the batch's


def group_figures(
    rewards: torch.Tensor, advantages: torch.Tensor, group_size: int
) -> dict[str, float]:
    """The trained groups' figures, from their rewards and advantages (float ``[N]``, groups of
    ``group_size``): ``groups/near_zero_std_share`` (groups whose reward std, unbiased, is below
    :data:`NEAR_ZERO` times the batch's), ``groups/near_zero_abs_adv`` (the mean ``|A|`` of
    their samples; NaN when none), ``adv/abs_mean`` and ``adv/abs_max`` over every sample."""
    r = rewards.double().view(-1, group_size)
    a = advantages.double().view(-1, group_size)
    if group_size < 2 or r.numel() < 2:
        return {}
    near = r.std(dim=1) < NEAR_ZERO * r.reshape(-1).std()
    out = {
        "groups/near_zero_std_share": float(near.double().mean()),
        "groups/near_zero_abs_adv": float(a[near].abs().mean()) if near.any() else math.nan,
        "adv/abs_mean": float(a.abs().mean()),
        "adv/abs_max": float(a.abs().max()),
    }
    return out


def trained_parameters(policy: MaskedImagePolicy) -> list[torch.Tensor]:
    return [p for p in policy.parameters() if p.requires_grad]


def update_size(before: list[torch.Tensor], policy: MaskedImagePolicy, lr: float) -> float:
    """``||theta_after - theta_before|| / lr`` over the trained parameters (``before``: their
    copies taken before the update). Adam's step is about ``lr`` per coordinate whatever the
    gradient's scale, so this reads how many coordinates moved how coherently: it grows with
    ``sqrt(#params)`` when every coordinate takes a full step."""
    sq = sum(
        float((p.detach() - b).double().square().sum())
        for p, b in zip(trained_parameters(policy), before, strict=True)
    )
    return math.sqrt(sq) / lr if lr > 0 else math.nan


def half_batch_cosine(
    policy: MaskedImagePolicy,
    batch: TrainBatch,
    units: torch.Tensor,
    s: UpdateSettings,
    ref_policy: MaskedImagePolicy | None = None,
) -> float:
    """The cosine between the loss gradients of the batch's first and second half of groups
    (each the gradient of its own mean, trained ``units``: long ``[K]``, or ``[N, K]`` per
    sample; the update's clip, KL and guards),
    on the weights before the update; NaN with fewer than two groups. The policy's gradients,
    mode and the global RNG state are restored."""
    groups = batch.num_samples // batch.group_size
    if groups < 2:
        return math.nan
    cut = (groups // 2) * batch.group_size
    params = trained_parameters(policy)
    saved = [p.grad for p in params]
    training = policy.training
    vecs = []
    try:
        with torch.random.fork_rng(devices=[]):
            policy.train()
            for a, b in ((0, cut), (cut, batch.num_samples)):
                half, u = batch.rows(a, b), units[a:b] if units.dim() == 2 else units
                for p in params:
                    p.grad = None
                accumulate_gradients(
                    policy, half, train_steps=u, micro_batch=s.micro_batch_pairs,
                    clip_low=s.clip_low, clip_high=s.clip_high, kl_coef=s.kl_coef,
                    ref_policy=ref_policy, guards=s.guards, autocast=s.autocast,
                    shrinkage=s.shrinkage,
                )  # fmt: skip
                grads = [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double()
                    for p in params
                ]
                vecs.append(torch.cat(grads))
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
        policy.train(training)
    den = float(vecs[0].norm() * vecs[1].norm())
    return float(vecs[0] @ vecs[1]) / den if den > 0 else math.nan
