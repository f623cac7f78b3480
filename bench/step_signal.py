"""Which unmasking steps carry the reward's signal: the per-step gradient's signal-to-noise.

    .venv/bin/python bench/step_signal.py [--config configs/toy.yaml] [--batches 12]
        [--after-steps 0,40] [--set KEY=VALUE ...] [--out bench/results_step_signal.json]

For the model after ``W`` training steps of the config (``--after-steps``; 0: the base model),
``K`` independent batches (``train.prompts_per_step`` prompts x G samples each, fresh rollouts)
give, for every unmasking step ``t``, the gradient ``g_t`` of the clipped objective restricted to
the pairs at step ``t`` (the first pass: ratio 1, so ``g_t = -mean_n A_n grad log p_t(n)``).
Across the ``K`` batches:

* ``cos_t``: the mean cosine between two batches' ``g_t``: ``|mu_t|^2 / E|g_t|^2`` in
  expectation, the share of one batch's gradient that is signal (the rest is noise);
* ``norm_t``: the mean ``|g_t|``;
* the same with the advantages shuffled within each group (a pure-noise signal of the same
  size): ``cos_t`` is then 0 in expectation, so the real ``cos_t`` measured against it tells
  whether step ``t``'s update has any direction at all.

A step whose gradient is as large as the others' but whose ``cos_t`` is near 0 adds noise, not
signal, to the trajectory's update: Adam scales it like the rest.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _policy_after(cfg, steps: int):
    """The config's policy after ``steps`` training steps (local backend, the run's seed)."""
    from safetensors.torch import load_file

    from maskgrpo_ray.build import build_policy
    from maskgrpo_ray.cli.app import run_train
    from maskgrpo_ray.config import load_config

    policy = build_policy(cfg.model)
    if steps == 0:
        return policy
    with tempfile.TemporaryDirectory() as d:
        over = [
            f"train.steps={steps}",
            "run.backend=local",
            "eval.every_steps=0",
            "logging.progress_bar=false",
            "run.export_final_policy=true",
        ]
        run_train(load_config(cfg_path(cfg), [*_OVERRIDES, *over]), Path(d))
        state = load_file(str(Path(d) / "final_policy.safetensors"))
    policy.load_state_dict(state, strict=False)
    return policy.eval()


_OVERRIDES: list[str] = []
_CONFIG: list[Path] = []


def cfg_path(_cfg) -> Path:
    return _CONFIG[0]


def step_gradients(policy, batch, num_steps: int) -> torch.Tensor:
    """``g_t`` for every step, flattened: float ``[S, P]``."""
    from maskgrpo_ray.step.learner_loss import accumulate_gradients

    params = [p for p in policy.parameters() if p.requires_grad]
    out = []
    policy.train()
    for t in range(num_steps):
        policy.zero_grad(set_to_none=True)
        accumulate_gradients(
            policy,
            batch,
            train_steps=torch.tensor([t]),
            micro_batch=4096,
            clip_low=0.2,
            clip_high=0.28,
        )
        out.append(
            torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]
            )
        )
    policy.eval()
    return torch.stack(out)


def shuffled(batch, g: torch.Generator):
    from dataclasses import replace

    adv = batch.advantages.view(-1, batch.group_size)
    perm = torch.stack([torch.randperm(batch.group_size, generator=g) for _ in range(adv.shape[0])])
    return replace(batch, advantages=torch.gather(adv, 1, perm).view(-1))


def measure(cfg, policy, n_batches: int) -> dict[str, list[float]]:
    from maskgrpo_ray.build import build_reward_from_settings
    from maskgrpo_ray.data import PromptStream, load_prompts
    from maskgrpo_ray.settings import advantage_settings, settings_from_config
    from maskgrpo_ray.step.phases import generate, make_train_batch, score

    s = settings_from_config(cfg)
    reward = build_reward_from_settings(s.reward)
    stream = PromptStream(load_prompts(cfg.data.prompts, "train"), 123, True)
    S = s.rollout.num_steps
    real, noise = [], []
    g = torch.Generator().manual_seed(7)
    for k in range(n_batches):
        prompts, idx = stream.take(cfg.train.prompts_per_step)
        rb = generate(
            policy,
            prompts,
            idx,
            policy_version=0,
            generator=torch.Generator().manual_seed(1000 + k),
            **s.rollout.kwargs(),
        )
        sc = score(reward, rb)
        keep = torch.isfinite(sc.rewards.view(-1, rb.group_size)).all(1)
        tb = make_train_batch(sc, keep, advantage_settings(cfg))
        real.append(step_gradients(policy, tb, S))
        noise.append(step_gradients(policy, shuffled(tb, g), S))
    out: dict[str, list[float]] = {}
    for name, gs in (("real", real), ("shuffled", noise)):
        G = torch.stack(gs)  # [K, S, P]
        cos, norm = [], []
        for t in range(S):
            v = torch.nn.functional.normalize(G[:, t], dim=-1)
            pairs = [float(v[i] @ v[j]) for i, j in itertools.combinations(range(len(gs)), 2)]
            cos.append(statistics.fmean(pairs))
            norm.append(float(G[:, t].norm(dim=-1).mean()))
        out[f"cos_{name}"], out[f"norm_{name}"] = cos, norm
        # the se of a mean of K(K-1)/2 dependent cosines: from the K per-batch means
        per_batch = []
        for i in range(len(gs)):
            per_batch.append(
                [
                    statistics.fmean(
                        float(
                            torch.nn.functional.normalize(G[i, t], dim=0)
                            @ torch.nn.functional.normalize(G[j, t], dim=0)
                        )
                        for j in range(len(gs))
                        if j != i
                    )
                    for t in range(S)
                ]
            )
        out[f"cos_{name}_se"] = [
            statistics.stdev([pb[t] for pb in per_batch]) / len(gs) ** 0.5 for t in range(S)
        ]
    return out


def main() -> None:
    from maskgrpo_ray.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "toy.yaml"))
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--after-steps", default="0,40")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_step_signal.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    _CONFIG.append(Path(a.config))
    _OVERRIDES.extend(a.overrides)
    cfg = load_config(a.config, a.overrides)
    results = {}
    for w in [int(x) for x in a.after_steps.split(",")]:
        policy = _policy_after(cfg, w)
        m = measure(cfg, policy, a.batches)
        results[str(w)] = m
        print(
            f"after {w} steps: step | cos real (se) | cos shuffled (se) | |g| real | |g| shuffled"
        )
        for t in range(len(m["cos_real"])):
            print(
                f"  {t:3d} | {m['cos_real'][t]:+.4f} ({m['cos_real_se'][t]:.4f}) | "
                f"{m['cos_shuffled'][t]:+.4f} ({m['cos_shuffled_se'][t]:.4f}) | "
                f"{m['norm_real'][t]:.4f} | {m['norm_shuffled'][t]:.4f}",
                flush=True,
            )
    Path(a.out).write_text(
        json.dumps(
            {
                "config": a.config,
                "overrides": a.overrides,
                "batches": a.batches,
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
