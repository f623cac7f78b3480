"""What a step costs on named accelerators: the FLOP model, cost profiles and the pipeline ideal.

Everything here is arithmetic (no torch): the simulated accelerator (``model.kind: sim``,
:mod:`maskgrpo_ray.worlds.toy.sim`) sleeps for these seconds, ``maskgrpo plan`` recommends a
rollout/learner split from them, and ``bench/bench_cluster_sim.py`` holds the measured pipeline
to the ideal they imply. A figure from here is a *model* of a GPU, never a GPU measurement.

Vocabulary: ``r`` and ``l`` are the GPU-seconds one image costs in rollout and in training;
``R``, ``L`` and ``W`` are a step's rollout, learner and weight-sync seconds on a given split.

* **FLOP model** (:class:`FlopModel`, also what ``bench/bench_gpu.py`` reports MFU against):
  ``2 x matmul parameters x rows`` per forward plus the attention products
  (``4 x layers x hidden x rows x keys``); a forward-backward pair is 3 forwards.
* **Profiles** (:class:`CostProfile`): seconds per image per unmasking step (rollout), per
  (sample, unit) pair forward+backward (learner), per image (reward), the synced weight bytes
  and the sync bandwidth. The built-in ones (:data:`PROFILES`) are Show-o at 256 and 512 px on
  an H100 at the MFUs measured there (:data:`H100_MEASURED`; ``docs/simulation.md`` gives every
  number and its source); a user
  writes their own in ``model.args.profile`` (a mapping of the same fields).
* **Pipeline** (:func:`step_costs`, :func:`pipeline_ideal`, :func:`plan_split`): a step's
  ``R = ceil(B / rollout GPUs) G (S + K) c_rollout`` (a prompt's group is one rollout actor's
  work; ``K`` passes score the forward estimator's old log-probs, none for the trajectory one),
  ``L = ceil(N / learner GPUs) u c_pair`` (samples are spread evenly over learner ranks),
  ``W = weight bytes / bandwidth``; synchronous steps take ``R + L + W``, asynchronous ones
  ``max(R, L + W)``; no split of ``n`` GPUs beats the work-conserving ``n / (r + l)`` images/s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any

# dense bf16 datasheet rates (FLOP/s); the first name that is part of a device's name wins
PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


def peak_bf16(device_name: str) -> float | None:
    """The dense bf16 peak of the first :data:`PEAK_BF16` name contained in ``device_name``."""
    for name, rate in PEAK_BF16:
        if name.lower() in device_name.lower():
            return rate
    return None


@dataclass(frozen=True)
class FlopModel:
    """Model FLOPs: 2 x matmul parameters x tokens per forward (attention products apart)."""

    body_params: int  # the transformer layers' parameters: every text and image row
    head_params: int  # lm_head's codebook columns: image-token rows only
    text_len: int  # P
    hidden: int
    layers: int

    def forward(self, image_len: int, samples: int, prefixes: int) -> float:
        """``samples`` image passes of ``L + 2`` rows and ``prefixes`` text prefixes."""
        image = self.body_params * (image_len + 2) + self.head_params * image_len
        return 2.0 * (samples * image + prefixes * self.body_params * self.text_len)

    def attention(self, image_len: int) -> float:
        """Attention products of one image pass (QK^T and AV: 4 x rows x keys x hidden per
        layer), which :meth:`forward` does not count."""
        rows = image_len + 2
        return 4.0 * self.layers * self.hidden * rows * (self.text_len + rows)

    def attention_share(self, image_len: int) -> float:
        """:meth:`attention` over the counted FLOPs of one image pass."""
        return self.attention(image_len) / self.forward(image_len, 1, 0)

    def image_pass(self, image_len: int) -> float:
        """All FLOPs of one image pass (counted + attention), text prefix reused."""
        return self.forward(image_len, 1, 0) + self.attention(image_len)


# Show-o v1 (Phi-1.5 body, 24 layers of 2048): parameter counts summed from the full-size
# checkpoint's key list, the official `Showo` class (showlab/Show-o, models/modeling_showo.py
# and models/phi.py) instantiated at the showlab/show-o-512x512 size: 437 tensors,
# 1,448,176,770 numbers, of which 1,208,510,464 in the 24 layers and the final LayerNorm
# (tests/test_cost_model.py sums them from the repository's copy of that list).
SHOWO_FLOPS = FlopModel(
    body_params=1_208_510_464, head_params=8192 * 2049, text_len=129, hidden=2048, layers=24
)
SHOWO_PARAMS = 1_448_176_770  # every tensor of the checkpoint (what a full weight sync moves)


@dataclass(frozen=True)
class CostProfile:
    """Per-unit costs of one model on one accelerator (GPU-seconds), and its workload defaults.

    The workload defaults (``prompts_per_step`` ... ``updates_per_batch``) are the paper's
    setting the profile was made for; ``maskgrpo plan`` uses them unless told otherwise, a
    training run uses its config's.
    """

    name: str
    device: str
    source: str  # how the numbers were obtained (FLOP model + MFU, or a measurement)
    rollout_seconds_per_image_step: float  # one image, one unmasking step (CFG included)
    rollout_batch_images: int  # the batch that figure holds at (a chunk's images)
    learner_seconds_per_pair: float  # one (sample, unit) pair, forward + backward
    reward_seconds_per_image: float
    weight_bytes: int  # what a weight sync sends to each rollout actor
    sync_bytes_per_second: float  # learner -> rollout bandwidth of the weight sync
    image_px: int  # the image side the rollout decodes (data volumes)
    image_tokens: int  # L
    prompts_per_step: int = 16  # B
    samples_per_prompt: int = 6  # G
    unmasking_steps: int = 50  # S
    estimator: str = "trajectory"  # "trajectory" (units: steps) | "forward" (mask draws)
    mask_draws: int = 4  # K, forward estimator
    updates_per_batch: int = 1
    # of learner_seconds_per_pair, the per-pair scoring (Eq. 14's sums, the Gumbel marginal's
    # quadrature) that trajectory shrinkage does not share between the steps of a block; the
    # rest (the model's forward and backward, the log_softmax) is paid once per input row
    learner_scoring_share: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.learner_scoring_share < 1.0:
            raise ValueError(
                f"cost profile {self.name!r}: learner_scoring_share={self.learner_scoring_share}"
                " must be in [0, 1) (a share of learner_seconds_per_pair); fix the profile"
            )
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "learner_scoring_share":
                continue
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
                raise ValueError(
                    f"cost profile {self.name!r}: {f.name}={v} must be > 0 (a cost, a size or "
                    "a count); fix the profile"
                )
        if self.estimator not in ("trajectory", "forward"):
            raise ValueError(
                f"cost profile {self.name!r}: estimator={self.estimator!r} must be 'trajectory' "
                "or 'forward'"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Measured on one H100 80GB HBM3 (bench/bench_gpu.py, 2026-11-27, bf16, random weights;
# docs/gpu.md, "Measured on an H100", the only record: the raw results file was lost): per
# (image side, likelihood), rollout seconds per image-step (N = 24 images a call at 512 px, 48
# at 256) and learner seconds per pair (micro-batch 8 at 512 px, the config's; 16 at 256).
# "marginal": the shipped configs' p1 with the Gumbel noise integrated out; "eq14": Eq. 14 as
# printed, also what a forward-estimator pair costs.
H100_MEASURED: dict[tuple[int, str], tuple[float, float]] = {
    (512, "marginal"): (20.27 / (24 * 50), 3.017 / 48),
    (512, "eq14"): (12.47 / (24 * 50), 1.643 / 48),
    (256, "marginal"): (4.223 / (48 * 18), 1.026 / 48),
    (256, "eq14"): (2.359 / (48 * 18), 0.5197 / 48),
}
H100_PEAK = 989e12  # the dense bf16 rate the measured seconds are read against


def measured_scoring_share(image_px: int) -> float:
    """The share of a measured marginal-likelihood pair (the shipped configs' p1, learner
    side) that is per-pair scoring, at the nearest measured side: what the Gumbel marginal's
    quadrature costs over Eq. 14 at the same micro-batch, ``1 - eq14 / marginal`` (0.455 at
    512 px: 28.6 of 62.9 ms; 0.493 at 256 px). A lower bound: Eq. 14's own per-pair sums stay
    in the rest (memory-bound passes over the remasked positions, small beside the forward)."""
    px = min((p for p, _ in H100_MEASURED), key=lambda p: abs(p - image_px))
    return 1.0 - H100_MEASURED[(px, "eq14")][1] / H100_MEASURED[(px, "marginal")][1]


def measured_mfu(image_px: int, likelihood: str) -> tuple[float, float]:
    """(rollout, learner) MFU that the H100 measurement gives Show-o at the nearest measured
    side, counted as the profiles count (image pass incl. attention; 3 passes per pair)."""
    px = min((p for p, _ in H100_MEASURED), key=lambda p: abs(p - image_px))
    rollout_s, pair_s = H100_MEASURED[(px, likelihood)]
    image_pass = SHOWO_FLOPS.image_pass((px // 16) ** 2)
    return image_pass / (rollout_s * H100_PEAK), 3.0 * image_pass / (pair_s * H100_PEAK)


def showo_profile(
    name: str,
    image_px: int,
    *,
    estimator: str = "trajectory",
    unmasking_steps: int,
    updates_per_batch: int = 1,
    rollout_mfu: float | None = None,
    learner_mfu: float | None = None,
    device: str = "H100 SXM",
) -> CostProfile:
    """Show-o at ``image_px`` on ``device`` from :data:`SHOWO_FLOPS` at the stated MFUs, by
    default those measured on an H100 (:func:`measured_mfu`; a forward-estimator pair at Eq.
    14's): an H100 gets the measured seconds, another device that efficiency at its peak."""
    tokens = (image_px // 16) ** 2
    peak = peak_bf16(device)
    if peak is None:
        raise ValueError(f"no dense bf16 peak known for {device!r} (cost_model.PEAK_BF16)")
    pair_likelihood = "marginal" if estimator == "trajectory" else "eq14"
    measured = rollout_mfu is None and learner_mfu is None
    if rollout_mfu is None:
        rollout_mfu = measured_mfu(image_px, "marginal")[0]
    if learner_mfu is None:
        learner_mfu = measured_mfu(image_px, pair_likelihood)[1]
    how = (
        "measured on an H100 on 2026-11-27 (planner.cost_model.H100_MEASURED)"
        if measured
        else "stated"
    )
    image_pass = SHOWO_FLOPS.image_pass(tokens)
    clip = VIT_H14_IMAGE_FLOPS  # the reward: CLIP ViT-H-14 (maskgrpo_ray.planner.reward_cost: a config's)
    return CostProfile(
        name=name,
        device=device,
        source=(
            "FLOP model (maskgrpo_ray.planner.cost_model.SHOWO_FLOPS; python -m pydoc "
            f"maskgrpo_ray.planner.cost_model): {image_pass:.3g} FLOP per "
            f"image pass at L={tokens} incl. attention; MFUs {how}: rollout "
            f"{rollout_mfu:.1%} (CFG 0, one pass per image-step, the marginal likelihood), "
            f"learner {learner_mfu:.1%} (3 passes per pair, {pair_likelihood}; "
            f"{measured_scoring_share(image_px) if estimator == 'trajectory' else 0.0:.1%} of "
            "a pair per-pair scoring, the marginal over Eq. 14 as measured), "
            f"{device} bf16 peak {peak / 1e12:.0f} TFLOP/s; reward CLIP ViT-H-14 at 30% MFU; "
            "weights: 1.448B params in bf16; sync 25 GB/s (NCCL broadcast, one node)"
        ),
        rollout_seconds_per_image_step=image_pass / (rollout_mfu * peak),
        rollout_batch_images=12,
        learner_seconds_per_pair=3.0 * image_pass / (learner_mfu * peak),
        reward_seconds_per_image=clip / (0.30 * peak),
        weight_bytes=2 * SHOWO_PARAMS,
        sync_bytes_per_second=25e9,
        image_px=image_px,
        image_tokens=tokens,
        unmasking_steps=unmasking_steps,
        estimator=estimator,
        updates_per_batch=updates_per_batch,
        learner_scoring_share=measured_scoring_share(image_px)
        if estimator == "trajectory"
        else 0.0,
    )


VIT_H14_IMAGE_FLOPS = 2.0 * 632e6 * 257  # ViT-H-14 image tower at 224 px: ~632M params x 257 tokens
"""The reward side of a config's own components: :mod:`maskgrpo_ray.planner.reward_cost`."""


# Built-in profiles by name (docs/simulation.md states each number's source).
PROFILES: dict[str, CostProfile] = {}
for _px, _steps in ((512, 50), (256, 18)):
    for _suffix, _estimator, _updates in (("", "trajectory", 1), ("_forward", "forward", 4)):
        _name = f"showo_{_px}_h100{_suffix}"
        PROFILES[_name] = showo_profile(
            _name,
            _px,
            estimator=_estimator,
            unmasking_steps=_steps,
            updates_per_batch=_updates,  # the forward configs' 4 inner updates (K = 4 draws)
        )


def resolve_profile(spec: str | Mapping[str, Any]) -> CostProfile:
    """A built-in profile by name, or a user's profile: a mapping of :class:`CostProfile`
    fields, optionally ``base: <built-in name>`` to start from; a clear error names the field."""
    if isinstance(spec, str):
        if spec not in PROFILES:
            raise ValueError(
                f"model.args.profile={spec!r} is not a built-in cost profile; built-in: "
                f"{', '.join(sorted(PROFILES))}; or give a mapping of its fields "
                "(docs/simulation.md)"
            )
        return PROFILES[spec]
    spec = dict(spec)
    base_name = spec.pop("base", None)
    known = {f.name for f in fields(CostProfile)}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(
            f"model.args.profile: unknown field(s) {unknown}; a profile has {sorted(known)}"
        )
    if base_name is not None:
        return replace(resolve_profile(str(base_name)), **spec)
    missing = sorted(known - set(spec) - _DEFAULTED)
    if missing:
        raise ValueError(
            f"model.args.profile: missing field(s) {missing}; give them, or 'base: "
            f"<one of {', '.join(sorted(PROFILES))}>' to start from a built-in profile"
        )
    return CostProfile(**spec)


_DEFAULTED = {f.name for f in fields(CostProfile) if f.default is not MISSING}


# a forward pass without backward, in forward-backward passes (backward ~ 2 forwards)
RECOMPUTE_SHARE = 1.0 / 3.0


@dataclass(frozen=True)
class Workload:
    """What one step does: ``B`` prompts of ``G`` samples, ``S`` unmasking steps, and the
    (sample, unit) pairs trained per sample (``units x updates``)."""

    prompts_per_step: int  # B
    samples_per_prompt: int  # G
    unmasking_steps: int  # S
    units_per_sample: int  # trained units per pass: S x trained share, or K
    updates_per_batch: int = 1
    scoring_passes: int = 0  # rollout passes per image after the S steps (forward: K old log-probs)
    estimator: str = ""  # the config's ("trajectory" | "forward"); "" when from a profile
    shrinkage: int = 1  # s, trajectory shrinkage: units scored per forward pass

    @property
    def images(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def forward_passes_per_sample(self) -> int:
        """The learner's forward-backward passes per sample and pass over the batch: the units,
        or ``ceil(units / s)`` blocks under trajectory shrinkage."""
        return math.ceil(self.units_per_sample / self.shrinkage)

    @property
    def pairs_per_sample(self) -> float:
        """:meth:`learner_pairs` of a profile whose whole pair cost is paid per input row
        (``learner_scoring_share`` 0)."""
        return self.learner_pairs(0.0)

    def learner_pairs(self, scoring_share: float) -> float:
        """Learner work per sample in (sample, unit) pairs' forward-backward passes, when a
        pair costs ``1 - f`` per model input row (the forward and backward, the log_softmax)
        and ``f`` per pair (the scoring, ``f = scoring_share``): per pass over the batch
        ``rows (1 - f) + units f``, rows the :attr:`forward_passes_per_sample`, times the inner
        updates; under shrinkage, plus the no-grad recomputation of the old log-probs
        (``RECOMPUTE_SHARE`` of the same). At ``s = 1`` rows = units: ``units x updates``."""
        f = scoring_share
        per_pass = self.forward_passes_per_sample * (1.0 - f) + self.units_per_sample * f
        recompute = per_pass * RECOMPUTE_SHARE if self.shrinkage > 1 else 0.0
        return per_pass * self.updates_per_batch + recompute

    @staticmethod
    def of_profile(p: CostProfile) -> Workload:
        forward = p.estimator == "forward"
        return Workload(
            p.prompts_per_step,
            p.samples_per_prompt,
            p.unmasking_steps,
            p.mask_draws if forward else p.unmasking_steps,
            p.updates_per_batch,
            p.mask_draws if forward else 0,
        )


@dataclass(frozen=True)
class StepCosts:
    """One step's seconds on a split (rollout GPUs, learner GPUs), and per-image GPU-seconds."""

    rollout_gpus: int
    learner_gpus: int
    rollout_s: float  # R
    learner_s: float  # L
    sync_s: float  # W
    reward_s: float  # the reward actors' seconds (beside R: they overlap the rollouts)
    r: float  # rollout GPU-seconds per image
    l: float  # learner GPU-seconds per image  # noqa: E741 - the name
    images: int  # trained per step (B x G)


def workload_of(cfg: Any) -> Workload:
    """The step a run config (:class:`maskgrpo_ray.config.Config`) runs, in the cost model's
    terms: its B, G, S, the units trained per sample and pass (the unmasking-step selection's
    ``k``, or the mask draws, one with ``draws_per_update: one``) and the inner updates."""
    from maskgrpo_ray.pipeline.settings import settings_from_config

    up = settings_from_config(cfg).update
    forward = cfg.likelihood.estimator == "forward"
    if up.cycle_units:
        units = 1
    elif up.step_selection == "all":
        units = up.num_steps
    else:
        units = up.steps_trained
    return Workload(
        prompts_per_step=cfg.train.prompts_per_step,
        samples_per_prompt=cfg.rollout.samples_per_prompt,
        unmasking_steps=cfg.rollout.unmasking_steps,
        units_per_sample=units,
        updates_per_batch=up.updates_per_batch,
        scoring_passes=cfg.likelihood.forward.mask_draws if forward else 0,
        estimator=cfg.likelihood.estimator,
        shrinkage=up.shrinkage,
    )


def probe_overhead(cfg: Any) -> tuple[float, float]:
    """The step-signal probe's work (``train.step_signal_every_steps``) spread over the images a
    run trains: (learner (sample, step) pairs, rollout images) per trained image. A probe takes
    ``K`` batches of ``P`` prompts (``G`` samples each) and ``2 K S`` gradient passes over a
    batch's samples, every ``N`` driver steps of ``B G`` images: ``2 K S P / (N B)`` pairs and
    ``K P / (N B)`` images per trained image. Not in :func:`plan_split`'s split (a probe runs
    between steps, on the same GPUs); (0, 0) with the probe off."""
    t = cfg.train
    if not t.step_signal_every_steps:
        return 0.0, 0.0
    p = t.step_signal_prompts_per_batch or t.prompts_per_step
    share = t.step_signal_batches * p / (t.step_signal_every_steps * t.prompts_per_step)
    return 2 * cfg.rollout.unmasking_steps * share, share


def step_costs(p: CostProfile, w: Workload, rollout_gpus: int, learner_gpus: int) -> StepCosts:
    """``R``, ``L``, ``W`` of one step on ``rollout_gpus`` + ``learner_gpus`` (see the module
    docstring for the granularity: whole groups per rollout actor, samples per learner rank)."""
    if rollout_gpus < 1 or learner_gpus < 1:
        raise ValueError("a split needs at least one rollout and one learner GPU")
    r = (w.unmasking_steps + w.scoring_passes) * p.rollout_seconds_per_image_step
    l_img = w.learner_pairs(p.learner_scoring_share) * p.learner_seconds_per_pair
    prompts_per_gpu = math.ceil(w.prompts_per_step / rollout_gpus)
    samples_per_rank = math.ceil(w.images / learner_gpus)
    return StepCosts(
        rollout_gpus=rollout_gpus,
        learner_gpus=learner_gpus,
        rollout_s=prompts_per_gpu * w.samples_per_prompt * r,
        learner_s=samples_per_rank * l_img,
        sync_s=p.weight_bytes / p.sync_bytes_per_second,
        reward_s=w.images * p.reward_seconds_per_image,
        r=r,
        l=l_img,
        images=w.images,
    )
