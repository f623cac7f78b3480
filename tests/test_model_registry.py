"""The model registry: built-in kinds by name, unknown kinds, and a third kind from a plugin.

This module is itself the plugin: importing it registers ``tiny_standin``, a small masked image
policy with its own mask schedule (linear) and Gumbel anneal (none). Runs name it in
``model.plugins`` (by file path) so that Ray actor processes, which never ran this test's
imports, import it too: Ray gives local workers the driver's working directory and script
folder on ``sys.path``, not the ``tests/`` folder pytest added, so a module name would not do.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import pytest
import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from maskgrpo_ray.config import Config, ConfigError, ModelConfig, load_config
from maskgrpo_ray.config.kinds import kind_names, rules_for
from maskgrpo_ray.models.base import LogitsFn, MaskedImagePolicy, cfg_mix
from maskgrpo_ray.models.registry import ModelEntry, get_model, model_kinds, register_model
from maskgrpo_ray.pipeline.phases import generate
from maskgrpo_ray.worlds.toy import world as toyworld

TOY = os.path.join(os.path.dirname(__file__), "..", "configs", "toy.yaml")
KIND = "tiny_standin"
PLUGIN = os.path.abspath(__file__)  # this file: Ray workers get the driver's cwd, not tests/


class TinyArgs(BaseModel):
    """``model.args`` of the stand-in kind."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    grid: int = 4
    d_model: int = 16
    cell_px: int = 4


def linear_schedule(step: int, num_steps: int, num_tokens: int, num_masked: int) -> int:
    """``m_t = floor(L * (1 - (t+1)/S))``, clamped like Show-o's (commit one, keep one)."""
    if step >= num_steps - 1:
        return 0
    return max(1, min(num_masked - 1, math.floor(num_tokens * (1 - (step + 1) / num_steps))))


def constant_tau(tau: float, step: int, num_steps: int) -> float:
    """No anneal: every step uses ``tau_0``."""
    return tau


class TinyStandin(MaskedImagePolicy):
    """Per-position logits from the image token, its position and the mean caption embedding."""

    mask_schedule = staticmethod(linear_schedule)
    gumbel_anneal = staticmethod(constant_tau)

    def __init__(self, args: TinyArgs) -> None:
        super().__init__()
        self.args = args
        self.codebook_size = len(toyworld.PALETTE)  # V
        self.num_image_tokens = args.grid * args.grid  # L
        self.image_grid = (args.grid, args.grid)
        d = args.d_model
        self.text = nn.Embedding(len(toyworld.WORDS), d)
        self.image = nn.Embedding(self.codebook_size + 1, d)  # + mask
        self.pos = nn.Parameter(0.02 * torch.randn(self.num_image_tokens, d))
        self.head = nn.Linear(d, self.codebook_size)

    def tokenize(self, prompts: Sequence[str]) -> torch.Tensor:
        p = toyworld.CAPTION_TOKENS
        rows = [[toyworld.WORDS.index(w) for w in s.lower().split()][:p] for s in prompts]
        if any(not r for r in rows):
            raise ValueError(f"empty prompt in {list(prompts)}")
        return torch.tensor([r + [0] * (p - len(r)) for r in rows], device=self.pos.device)

    def null_condition(self, n: int) -> torch.Tensor:
        ids = torch.zeros(n, toyworld.CAPTION_TOKENS, dtype=torch.long, device=self.pos.device)
        ids[:, 0] = 1  # <null>
        return ids

    def _logits(self, tokens: torch.Tensor, cond_ids: torch.Tensor) -> torch.Tensor:
        text = self.text(cond_ids).mean(1, keepdim=True)  # [N, 1, d]
        return self.head(torch.tanh(self.image(tokens) + self.pos + text)).float()  # [N, L, V]

    def conditioned(self, cond_ids: torch.Tensor, guidance_scale: float = 0.0) -> LogitsFn:
        null = self.null_condition(cond_ids.shape[0])
        return lambda t: cfg_mix(self._logits(t, cond_ids), self._logits(t, null), guidance_scale)

    def decode_images(self, image_tokens: torch.Tensor) -> torch.Tensor:
        return toyworld.decode_palette(image_tokens, self.args.grid, self.args.cell_px)


def _build(model: ModelConfig, device: torch.device) -> TinyStandin:
    torch.manual_seed(0)  # the same initial weights in every process
    return TinyStandin(TinyArgs.model_validate(model.args)).to(device)


def _reward_defaults(model: ModelConfig, reward_kind: str) -> dict[str, int]:
    return {"grid": TinyArgs.model_validate(model.args).grid} if reward_kind == "toy_rules" else {}


register_model(
    KIND, ModelEntry(build=_build, config_section=TinyArgs, reward_defaults=_reward_defaults)
)

RUN = [
    f"model.kind={KIND}",
    f"model.plugins=[{PLUGIN}]",
    "model.args={grid: 4, d_model: 16}",
    "train.steps=1",
    "train.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.unmasking_steps=4",
    "rollout.gumbel_temperature=1.0",
    "filter.enabled=false",
    "eval.samples_per_prompt=1",
    "logging.progress_bar=false",
    "logging.sample_grid_every_steps=0",
]


def test_builtin_kinds_registered_by_name():
    assert {"toy", "showo", KIND} <= set(model_kinds())
    assert get_model("toy").config_section.__name__ == "ToyModelConfig"
    assert get_model("showo").config_section.__name__ == "ShowoModelConfig"
    assert get_model(KIND).config_section is TinyArgs


def test_registering_a_kind_registers_its_config_rules():
    # validating a config finds a kind's rules in config.kinds (the config imports no model):
    # register_model put them there, the same objects as the entry's
    for kind in ("toy", "shapes", KIND):
        entry, rules = get_model(kind), rules_for(kind)
        assert (rules.section, rules.check) == (entry.config_section, entry.check)
    assert get_model("toy").check is not None  # the toy rule below is one of them
    assert kind_names() == model_kinds()


def test_unknown_kind_is_a_config_error_naming_the_kinds():
    with pytest.raises(ConfigError) as err:
        load_config(TOY, ["model.kind=meissonic"])
    msg = str(err.value)
    assert "model.kind='meissonic'" in msg and "showo, sim, tiny_standin, toy" in msg
    assert "register_model" in msg and "model.plugins" in msg


def test_plugin_args_validated_by_its_section():
    with pytest.raises(ConfigError, match="model.*grdi"):
        load_config(TOY, [*RUN, "model.args={grdi: 4}"])
    with pytest.raises(ConfigError, match="cannot import 'no_such_plugin_module'"):
        load_config(TOY, ["model.plugins=[no_such_plugin_module]"])


def test_kind_checks_and_reward_defaults_come_from_the_entry():
    from maskgrpo_ray.pipeline.settings import settings_from_config

    with pytest.raises(ConfigError, match="exceeds the toy image's 16 tokens"):
        load_config(TOY, ["rollout.unmasking_steps=17"])  # toy: S <= grid**2
    cfg = load_config(TOY, [*RUN, "model.args={grid: 2}", "rollout.unmasking_steps=17"])
    assert cfg.model.kind == KIND  # the toy rule is the toy kind's, not every kind's
    (spec,) = settings_from_config(cfg).reward.specs
    assert spec.kwargs == {"grid": 2}  # from the stand-in's hook
    (spec,) = settings_from_config(load_config(TOY, ["model.toy.grid=6"])).reward.specs
    assert spec.kwargs == {"grid": 6}  # from the toy kind's hook


def test_generate_uses_the_policys_schedule_and_anneal():
    """L = 16, S = 4, linear schedule: m_t = floor(16 (1 - (t+1)/4)) = 12, 8, 4, 0, so each
    step commits 4 tokens (Show-o's cosine would commit 2, 3, 5, 6: floors of 16 cos(pi/8 ...)
    = 14, 11, 6, 0); constant anneal: likelihood_tau = tau_0 at every step."""
    policy = _build(ModelConfig(kind=KIND, args={"grid": 4}), torch.device("cpu"))
    rb = generate(
        policy,
        ["one red dot on the left", "two blue dots on the top"],
        [0, 1],
        group_size=3,
        num_steps=4,
        temperature=1.0,
        gumbel_temperature=0.75,
        guidance_scale=0.0,
        transition="p1",
        policy_version=0,
        generator=torch.Generator().manual_seed(0),
    )
    commits = torch.stack([(rb.unmask_step == t).sum(-1) for t in range(4)], dim=1)  # [N, S]
    assert commits.tolist() == [[4, 4, 4, 4]] * 6
    assert rb.likelihood_tau.tolist() == [0.75] * 4  # float32-exact; Show-o: 0.75 * 3/4 ...


def _one_step(cfg: Config, run_dir) -> dict:
    from maskgrpo_ray.cli import run_train

    summary = run_train(cfg, run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]
    assert rows[0]["groups_trained"] == 2 and math.isfinite(rows[0]["loss"])
    return summary


def test_plugin_kind_trains_one_step_local(tmp_path):
    summary = _one_step(load_config(TOY, [*RUN, "run.backend=local"]), tmp_path)
    assert summary["policy_version"] == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_plugin_kind_trains_one_step_ray(ray_cluster, tmp_path):
    """Rollout actors and the learner rank build the kind from ``model.plugins`` alone."""
    cfg = load_config(
        TOY,
        [
            *RUN,
            "run.backend=ray",
            "rollout.num_actors=1",
            "reward.num_actors=1",
            "learner.num_workers=1",
            "rollout.num_cpus_per_actor=0.25",
            "reward.num_cpus_per_actor=0.25",
            "learner.num_cpus_per_worker=0.25",
        ],
    )
    summary = _one_step(cfg, tmp_path)
    assert summary["policy_version"] == 1 and summary["backend"] == "ray"
