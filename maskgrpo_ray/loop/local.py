"""The single-process executor: every phase in this process. The baseline the distributed
system is measured against, and the engine of the tests and ablations."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.algo.filtering import StdHistoryFilter
from maskgrpo_ray.config import Config
from maskgrpo_ray.evaluation.generation import evaluate_rewards, generate_unit, grid_unit
from maskgrpo_ray.loop.collect import Chunk, chunk_prompts_of
from maskgrpo_ray.loop.snapshot import host_copy
from maskgrpo_ray.loop.step_signal_probe import StepSignal, measure
from maskgrpo_ray.models.base import MaskedImagePolicy, prompt_problems
from maskgrpo_ray.pipeline.build import attach_judge
from maskgrpo_ray.pipeline.data_plane import Traffic
from maskgrpo_ray.pipeline.diagnostics import half_batch_cosine, trained_parameters, update_size
from maskgrpo_ray.pipeline.ema import ParameterEma
from maskgrpo_ray.pipeline.learner_core import (
    TorchOptimizing,
    UpdatePlanner,
    apply_activation_checkpointing,
    apply_update,
    build_optimizer,
    frozen_base,
    reference_policy,
)
from maskgrpo_ray.pipeline.messages import RolloutBatch, ScoredBatch, TrainBatch
from maskgrpo_ray.pipeline.phases import FilterResult, filter_groups, generate, score
from maskgrpo_ray.pipeline.reward_refresh import STATE_FILE, make_refresher, refresh_state_path
from maskgrpo_ray.pipeline.settings import settings_from_config
from maskgrpo_ray.weights.safe_files import load_torch_file


class LocalExecutor:
    """Generate, score, filter and update in one process.

    Rollouts are cut into the chunks a Ray run with the same config would send to its rollout
    actors, each generated with its chunk's seed, so a run here is the reference of the
    distributed one (lag 0 and lag 1 alike). With ``train.ema_decay`` the weights' moving
    average (``pipeline.ema``) is what evaluation, the grids and the export see; rollouts and
    updates keep the live weights."""

    runs_ahead = False  # a submission ahead runs at once, before the update

    def __init__(
        self, cfg: Config, policy: MaskedImagePolicy, reward: Any, filt: StdHistoryFilter | None
    ) -> None:
        self.settings = settings_from_config(cfg)
        self.policy, self.reward, self.filt = policy, reward, filt
        ckpt = self.settings.learner.activation_checkpointing
        apply_activation_checkpointing(policy, ckpt, cfg.model.kind)
        up = self.settings.update
        self.optimizer = build_optimizer(up, policy)
        self.optimizing = TorchOptimizing(policy, self.optimizer, up.grad_clip_norm)
        self.planner = UpdatePlanner(up)
        self.ref_policy = reference_policy(up, policy)
        self.ema = ParameterEma(policy, up.ema_decay) if up.ema_decay > 0 else None
        # the base the monitor probe's KL is measured against: the KL term's reference, else a
        # frozen copy taken now, before any update or checkpoint load (logging.monitors.probe_kl)
        self.probe_base = self.ref_policy
        self.diagnostics = cfg.logging.diagnostics
        m = cfg.logging.monitors
        if self.probe_base is None and m.enabled and m.probe_kl and m.probe_prompts:
            self.probe_base = frozen_base(policy)
        ro = cfg.rollout
        self.chunk_prompts = chunk_prompts_of(
            ro.prompts_per_chunk, cfg.train.prompts_per_step, ro.num_actors
        )
        self.policy_version = 0
        self.prompt_meta: dict[str, Any] | None = None
        self._eval_reward: Any = None
        self.refresher = make_refresher(cfg, reward)  # reward.refresh; None: off

    def set_prompt_metadata(self, table: dict[str, Any]) -> None:
        """Prompt text -> its metadata, for rewards that read it (``uses_prompt_metadata``)."""
        self.prompt_meta = table

    def check_prompts(self, prompts: list[str]) -> list[str | None]:
        """Per prompt, None or why the policy cannot read it."""
        return prompt_problems(self.policy, prompts)

    def on_step_end(self, step: int, row: dict[str, Any]) -> None:
        """Nothing to control live in one process."""

    def generate_and_score(self, chunks: list[Chunk], traffic: Traffic) -> ScoredBatch:
        """The chunks' groups, each chunk generated with its own seed and scored, in order."""
        parts = []
        for ch in chunks:
            rb = generate(
                self.policy,
                ch.prompts,
                ch.positions,
                policy_version=self.policy_version,
                generator=torch.Generator().manual_seed(ch.seed),
                **self.settings.rollout.kwargs(),
            )
            parts.append(score(self.reward, rb, self.prompt_meta))
        return ScoredBatch.concat(parts)

    def filter(self, scored: ScoredBatch, traffic: Traffic) -> FilterResult:
        return filter_groups(scored, self.filt)

    def probe_rollouts(self, chunks: list[Chunk]) -> list[ScoredBatch]:
        """The step-signal probe's batches: each chunk generated with its seed and scored (the
        global RNG state kept: the run's own draws are the same with the probe or without)."""
        with torch.random.fork_rng(devices=[]):
            return [self.generate_and_score([ch], Traffic()) for ch in chunks]

    def step_signal(
        self, real: list[TrainBatch], shuffled: list[TrainBatch]
    ) -> tuple[StepSignal, list[int] | None]:
        """The measurement on this process's policy (``step_signal.measure``: its gradients,
        mode and RNG state restored), and the ``auto`` selection it leaves in force."""
        signal = measure(self.policy, real, shuffled, self.settings.update)
        return signal, self.planner.observe(signal)

    def filter_state(self) -> dict[str, Any] | None:
        return None if self.filt is None else self.filt.state_dict()

    def load_filter_state(self, state: dict[str, Any] | None) -> None:
        self.filt = None if state is None else StdHistoryFilter.from_state_dict(state)

    def restart_learner(self, lost: Exception, *, from_rollouts: bool = False) -> None:
        """The learner is this process: it cannot be lost on its own."""
        raise RuntimeError(f"the local backend has no separate learner to restart ({lost})")

    def filter_stats(self) -> dict[str, float]:
        return self.filt.stats() if self.filt is not None else {}

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """The learner's update (``learner_core.apply_update``) run in this process."""
        plan = self.planner.plan(self.policy_version, batch.num_samples, batch.group_size)
        up = self.settings.update
        before, extra = None, {}
        if self.diagnostics:  # logging.diagnostics: on the weights before the update
            units = plan.resolved(batch).units_for_pass(0)
            cos = half_batch_cosine(self.policy, batch, units, up, self.ref_policy)
            extra["diag/grad_half_cosine"] = cos
            before = [p.detach().clone() for p in trained_parameters(self.policy)]
        m = apply_update(self.optimizing, batch, plan, up, ref_policy=self.ref_policy, ema=self.ema)
        if before is not None:
            extra["diag/update_over_lr"] = update_size(before, self.policy, plan.learning_rate)
        self.policy_version += 1
        return {**m, **extra}

    def sync_weights(self) -> float:
        return 0.0  # the rollout uses the learner's weights directly

    def _evaluated(self) -> contextlib.AbstractContextManager[None]:
        """A block in which the policy holds the weights evaluation sees: the EMA, else live."""
        return self.ema.applied(self.policy) if self.ema is not None else contextlib.nullcontext()

    def refresh_reward(self, step: int, scored: ScoredBatch | None) -> dict[str, float]:
        """``reward.refresh``: the learned reward trains on this step's samples when due."""
        if self.refresher is None or scored is None:
            return {}
        rollout = scored.rollout
        assert isinstance(rollout, RolloutBatch)  # one process: the images are here
        return self.refresher(step, rollout)

    def evaluate(
        self, prompts: list[str], tags: list[str | None] | None = None, *, probe: bool = False
    ) -> dict[str, float]:
        """Held-out evaluation (``evaluation.generation.evaluate_rewards``) of the EMA, else
        of the live weights."""
        if self._eval_reward is None:  # the training reward's parts, with eval.geneval's judge
            device = next(self.policy.parameters()).device
            reward = self.reward  # a refreshed component is evaluated as loaded (frozen)
            if self.refresher is not None:
                reward = self.refresher.eval_reward(reward)
            self._eval_reward = attach_judge(reward, self.settings.reward, device)
        with self._evaluated():
            return evaluate_rewards(
                self.policy,
                self._eval_reward,
                prompts,
                self.settings.eval,
                tags,
                self.prompt_meta,
                probe=probe,
                base=self.probe_base if probe else None,
            )

    def eval_images(self, prompts: list[str]) -> torch.Tensor:
        """The per-tag evaluation grid's images (``evaluation.generation.grid_unit``)."""
        unit, settings = grid_unit(prompts, self.settings.eval)
        with self._evaluated():
            return generate_unit(self.policy, unit, settings).images

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The trained tensors the run exports (the EMA under ``train.ema_decay``)."""
        if self.ema is not None:
            return self.ema.weights(self.policy)
        return {
            n: p.detach().cpu().clone()
            for n, p in self.policy.named_parameters()
            if p.requires_grad
        }

    def extra_metrics(self) -> dict[str, float]:
        return {}

    def save(self, folder: Path) -> None:
        """Weights, optimizer, RNG streams and policy version into ``folder`` (the group source
        saves the filter's history): :meth:`snapshot`, written now."""
        self.snapshot()(folder)

    def snapshot(self) -> Callable[[Path], None]:
        """What :meth:`save` writes, copied to host memory now (``snapshot.host_copy``); the
        returned call writes it to a folder (on any thread)."""
        state = host_copy(
            {
                "policy.pt": self.policy.state_dict(),
                "optimizer.pt": self.optimizer.state_dict(),
                "executor.pt": {
                    "step_generator": self.planner.state(),
                    "torch": torch.get_rng_state(),
                    "policy_version": self.policy_version,
                },
                **({"ema.pt": self.ema.state_dict()} if self.ema is not None else {}),
            }
        )
        if self.refresher is not None:  # the refreshed reward and its optimiser
            state[STATE_FILE] = host_copy(self.refresher.state_dict())

        def write(folder: Path) -> None:
            for name, part in state.items():
                torch.save(part, folder / name)

        return write

    def load(self, folder: Path) -> None:
        self.policy.load_state_dict(load_torch_file(folder / "policy.pt", "a checkpoint's policy"))
        optimizer = load_torch_file(folder / "optimizer.pt", "a checkpoint's optimizer state")
        self.optimizer.load_state_dict(optimizer)
        state = load_torch_file(folder / "executor.pt", "a checkpoint's executor state")
        self.planner.load_state(state["step_generator"])
        torch.set_rng_state(state["torch"])
        self.policy_version = int(state["policy_version"])
        if self.ema is not None:
            path = folder / "ema.pt"
            ema = load_torch_file(path, "a checkpoint's EMA") if path.exists() else None
            self.ema.resume(self.policy, ema, str(folder))
        if self.refresher is not None:
            path = refresh_state_path(folder)  # the refreshed reward and its optimiser
            self.refresher.load_state_dict(load_torch_file(path, "a checkpoint's reward refresh"))

    def shutdown(self) -> None:
        pass
