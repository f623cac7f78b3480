"""A simulated accelerator (``model.kind: sim``): real tensors, a named GPU's time.

SIMULATION, not GPU speed. The policy is the toy world's real transformer (``model.toy``), so
every rollout, cached log-probability, reward, filter decision, learner update and weight sync
is real and the math is unchanged. On top, each call *takes the time* a cost profile
(:mod:`maskgrpo_ray.planner.cost_model`) gives the target model on the target accelerator, times one
``time_scale`` factor so that a run takes minutes:

* a rollout logits call on ``n`` images (no gradient) lasts ``n x rollout_seconds_per_image_step``;
* a learner pass on ``n`` (sample, unit) pairs (gradient on) lasts
  ``n x learner_seconds_per_pair`` from the forward's start to the backward's end (the hold
  is the backward's last node);
* a weight load lasts ``weight_bytes / sync_bytes_per_second``;
* the reward actors' ``sim_cost`` component (:mod:`maskgrpo_ray.rewards.sim_cost`) lasts
  ``n x reward_seconds_per_image`` per call.

A call sleeps until its simulated duration has passed since it began, so the tiny model's own
compute is inside the simulated time, not added to it (as a GPU kernel would be), while it is
shorter. Successive rollout calls of one logits function are one stream (a step begins where
the previous step's work ended), so the sampler's compute between them is inside it too.
Sleeping releases the GIL and holds no core: two cores host 16 or more simulated GPUs.

Data volumes follow the target scaled by ``bytes_scale``: the policy carries a ballast weight
tensor so that the trained tensors (what the learner all-reduces and syncs) weigh
``weight_bytes x bytes_scale``, and images are decoded at ``image_px x sqrt(bytes_scale)`` pixels
a side (a multiple of the grid), so a rollout's images weigh the target's ``x bytes_scale``. The
tokens and per-step records are the tiny model's (``L = grid^2``; under 2 % of Show-o 512's
rollout bytes, which are images). ``docs/simulation.md`` has the profiles and the bench.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from maskgrpo_ray.models.base import LogitsFn, MaskedImagePolicy
from maskgrpo_ray.models.registry import ModelEntry, register_model
from maskgrpo_ray.planner.cost_model import CostProfile, resolve_profile
from maskgrpo_ray.planner.cost_model import workload_of as cost_workload_of
from maskgrpo_ray.worlds.toy import world as toyworld
from maskgrpo_ray.worlds.toy.model import ToyPolicy, load_or_pretrain, spec_from_config

if TYPE_CHECKING:
    from maskgrpo_ray.config import Config, ModelConfig

log = logging.getLogger(__name__)

SIM_REWARD_KIND = "sim_cost"


class SimModelConfig(BaseModel):
    """``model.args`` of ``model.kind: sim`` (the tiny real policy is ``model.toy``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: str | dict[str, Any] = Field(
        "showo_512_h100",
        description="a built-in cost profile's name (cost_model.PROFILES) or a mapping of its "
        "fields (optionally 'base: <name>' to start from one)",
    )
    time_scale: float = Field(
        0.05, gt=0, description="simulated seconds x this = wall seconds (a step in ~1 s)"
    )
    bytes_scale: float = Field(
        1e-3, gt=0, le=1, description="target bytes x this = bytes moved (weights, images)"
    )

    @field_validator("profile")
    @classmethod
    def _known(cls, v: str | dict[str, Any]) -> str | dict[str, Any]:
        resolve_profile(v)  # a clear error names the profile or its field
        return v

    def cost_profile(self) -> CostProfile:
        return resolve_profile(self.profile)


def sim_settings(model: ModelConfig) -> SimModelConfig:
    return SimModelConfig.model_validate(model.args)


def image_side(profile: CostProfile, bytes_scale: float, grid: int) -> int:
    """Decoded image side: the target's ``image_px x sqrt(bytes_scale)``, a multiple of the
    grid (at least one pixel per cell)."""
    cell = max(1, round(profile.image_px * math.sqrt(bytes_scale) / grid))
    return grid * cell


def ballast_numel(profile: CostProfile, bytes_scale: float, policy: nn.Module) -> int:
    """float32 elements that bring the trained tensors to ``weight_bytes x bytes_scale``."""
    own = sum(p.numel() * p.element_size() for p in policy.parameters())
    return max(1, round((profile.weight_bytes * bytes_scale - own) / 4))


class SimClock:
    """Makes a call last its simulated seconds (``time_scale`` applied): sleep until then."""

    def __init__(self, time_scale: float) -> None:
        self.time_scale = time_scale
        self.simulated_s = 0.0  # simulated seconds charged (unscaled)
        self.slept_s = 0.0  # wall seconds slept
        self.over_s = 0.0  # wall seconds the real work ran past its simulated time

    def hold(self, began: float, simulated_s: float) -> float:
        """The work that began at ``began`` (``time.perf_counter``) lasts ``simulated_s``:
        sleep until ``began + simulated_s x time_scale``. Returns when the work ended (that
        time, or now if the real work ran past it)."""
        self.simulated_s += simulated_s
        due = began + simulated_s * self.time_scale
        left = due - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self.slept_s += left
            return due
        self.over_s -= left
        return time.perf_counter()


class _HoldAtBackwardEnd(torch.autograd.Function):
    """Identity on a parameter; its backward holds the clock until the pass's simulated time.

    Applied before the network runs, its node has the lowest sequence number of the pass's
    graph, and the autograd engine runs ready nodes highest number first: it is the last node
    of the backward. So the forward, the loss and the backward, all real compute between them,
    lie inside the one simulated duration (a GPU would run them as kernels within it).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, clock: SimClock, began: float, simulated_s: float
    ) -> torch.Tensor:
        ctx.clock, ctx.began, ctx.simulated_s = clock, began, simulated_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        ctx.clock.hold(ctx.began, ctx.simulated_s)
        return grad, None, None, None


class SimPolicy(MaskedImagePolicy):
    """The toy policy with a target accelerator's time and data volumes (module docstring)."""

    def __init__(self, toy: ToyPolicy, sim: SimModelConfig) -> None:
        super().__init__()
        self.toy, self.sim, self.profile = toy, sim, sim.cost_profile()
        self.codebook_size = toy.codebook_size
        self.num_image_tokens = toy.num_image_tokens
        self.image_grid = toy.image_grid
        self.clock = SimClock(sim.time_scale)
        self.side = image_side(self.profile, sim.bytes_scale, toy.spec.grid)
        self.ballast = nn.Parameter(torch.zeros(ballast_numel(self.profile, sim.bytes_scale, toy)))

    def tokenize(self, prompts: Sequence[str]) -> torch.Tensor:
        return self.toy.tokenize(prompts)

    def null_condition(self, n: int) -> torch.Tensor:
        return self.toy.null_condition(n)

    def set_activation_checkpointing(self, enabled: bool) -> bool:
        return self.toy.set_activation_checkpointing(enabled)

    def conditioned(self, cond_ids: torch.Tensor, guidance_scale: float = 0.0) -> LogitsFn:
        inner = self.toy.conditioned(cond_ids, guidance_scale)
        p = self.profile

        stream: list[float] = []  # when this function's previous call's work ended

        def fn(tokens: torch.Tensor) -> torch.Tensor:  # [n, L] -> [n, L, V]
            began = time.perf_counter()
            if torch.is_grad_enabled():  # a learner pass on n (sample, unit) pairs
                # forward, loss and backward inside one duration, held at the backward's end;
                # the ballast joins the graph (zero gradient) so it is all-reduced like weights
                seconds = tokens.shape[0] * p.learner_seconds_per_pair
                anchor = _HoldAtBackwardEnd.apply(self.ballast, self.clock, began, seconds)
                return inner(tokens) + 0.0 * anchor[:1].sum()
            # a rollout (or reference / evaluation) step on n images. Successive calls of one
            # function are one stream of device work: a step starts when the previous one's
            # work ended, so the sampler's own compute between two calls lies inside the
            # simulated time (as the sampler's kernels would on the device), not beside it
            logits = inner(tokens)
            start = stream[-1] if stream else began
            stream[:] = [self.clock.hold(start, tokens.shape[0] * p.rollout_seconds_per_image_step)]
            return logits

        return fn

    def decode_images(self, image_tokens: torch.Tensor) -> torch.Tensor:
        grid = self.toy.spec.grid
        return toyworld.decode_palette(image_tokens, grid, self.side // grid)

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Install weights; a load that carries the ballast is a weight sync and lasts the
        profile's ``weight_bytes / sync_bytes_per_second``."""
        began = time.perf_counter()
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if "ballast" in state_dict:
            p = self.profile
            self.clock.hold(began, p.weight_bytes / p.sync_bytes_per_second)
        return out


def _build(model: ModelConfig, device: torch.device) -> SimPolicy:
    toy = load_or_pretrain(spec_from_config(model.toy))
    return SimPolicy(toy, sim_settings(model)).to(device)


def _prepare(model: ModelConfig) -> None:
    load_or_pretrain(spec_from_config(model.toy))  # cached: actors load it, none pre-trains
    sim = sim_settings(model)
    log.warning(
        "model.kind=sim: SIMULATED accelerator (profile %s, %s; time_scale %g, bytes_scale %g): "
        "timings model that device, they are not GPU measurements",
        sim.cost_profile().name,
        sim.cost_profile().device,
        sim.time_scale,
        sim.bytes_scale,
    )


def _check(cfg: Config) -> None:
    steps, tokens = cfg.rollout.unmasking_steps, cfg.model.toy.grid**2
    if steps > tokens:
        raise ValueError(
            f"rollout.unmasking_steps={steps} exceeds the sim's tiny policy's {tokens} tokens "
            f"(model.toy.grid={cfg.model.toy.grid}): every step must commit a token; raise "
            "model.toy.grid or lower rollout.unmasking_steps"
        )
    if not any(c.kind == SIM_REWARD_KIND for c in cfg.reward.components):
        raise ValueError(
            f"model.kind=sim times the reward actors through a reward component of kind "
            f"{SIM_REWARD_KIND!r}; add {{kind: {SIM_REWARD_KIND}, weight: 0}} to "
            "reward.components"
        )


def _reward_defaults(model: ModelConfig, reward_kind: str) -> dict[str, Any]:
    if reward_kind in ("toy_rules", "toy_geneval"):
        return {"grid": model.toy.grid}
    if reward_kind == SIM_REWARD_KIND:
        sim = sim_settings(model)
        return {
            "seconds_per_image": sim.cost_profile().reward_seconds_per_image,
            "time_scale": sim.time_scale,
        }
    return {}


register_model(
    "sim",
    ModelEntry(
        build=_build,
        config_section=SimModelConfig,
        check=_check,
        prepare=_prepare,
        reward_defaults=_reward_defaults,
    ),
)


workload_of = cost_workload_of  # the step a config runs (cost_model.workload_of)
