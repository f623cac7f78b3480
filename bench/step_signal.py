"""Which unmasking steps carry the reward's signal: the per-step gradient's signal-to-noise.

    .venv/bin/python -m bench.step_signal [--config configs/toy.yaml] [--batches 12]
        [--after-steps 0,40] [--set KEY=VALUE ...] [--out bench/results_step_signal.json]
    .venv/bin/python -m bench.step_signal --config RUN/config.json --checkpoint RUN/checkpoints/step_000010
        --probe-step 10          # a run's own probe (train.step_signal_every_steps), reproduced

For the model after ``W`` training steps of the config (``--after-steps``; 0: the base model;
or the weights of ``--checkpoint``: a run's checkpoint folder or its ``final_policy``), ``K``
independent batches (``--prompts-per-batch`` prompts x G samples each, fresh rollouts) give,
for every unmasking step ``t``, the gradient ``g_t`` of the clipped objective restricted to the
pairs at step ``t`` (the first pass: ratio 1, so ``g_t = -mean_n A_n grad log p_t(n)``).
Across the ``K`` batches:

* ``cos_t``: the mean cosine between two batches' ``g_t``: ``|mu_t|^2 / E|g_t|^2`` in
  expectation, the share of one batch's gradient that is signal (the rest is noise);
* ``norm_t``: the mean ``|g_t|``;
* the same with the advantages shuffled within each group (a pure-noise signal of the same
  size): ``cos_t`` is then 0 in expectation, so the real ``cos_t`` measured against it tells
  whether step ``t``'s update has any direction at all.

The measurement is the library's (``maskgrpo_ray.loop.step_signal_probe``), the one a run's probe
makes (``train.step_signal_every_steps``). The bench's own batches are a prompt stream seeded
123 and rollout seeds 1000 + k; ``--probe-step J`` takes instead the batches a run's probe of
driver step ``J`` takes (its seeds, ``step_signal_batches`` x ``step_signal_prompts_per_batch``),
so that on the weights that probe saw, the bench gives the probe's numbers.

A step whose gradient is as large as the others' but whose ``cos_t`` is near 0 adds noise, not
signal, to the trajectory's update: Adam scales it like the rest.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _policy_after(config: Path, overrides: list[str], steps: int):
    """The config's policy after ``steps`` training steps (local backend, the run's seed)."""
    from safetensors.torch import load_file

    from maskgrpo_ray.cli.app import run_train
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.pipeline.build import build_policy

    policy = build_policy(load_config(config, overrides).model)
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
        run_train(load_config(config, [*overrides, *over]), Path(d))
        state = load_file(str(Path(d) / "final_policy.safetensors"))
    policy.load_state_dict(state, strict=False)
    return policy.eval()


def policy_of(cfg, where: Path):
    """The config's policy with the weights of a run's checkpoint folder (``policy.pt``, the
    local backend's) or of a ``final_policy.safetensors``."""
    from maskgrpo_ray.pipeline.build import build_policy
    from maskgrpo_ray.weights.safe_files import load_torch_file

    policy = build_policy(cfg.model)
    if where.is_dir() and (where / "policy.pt").exists():
        policy.load_state_dict(load_torch_file(where / "policy.pt", "a checkpoint's policy"))
    else:
        from safetensors.torch import load_file

        path = where / "final_policy.safetensors" if where.is_dir() else where
        policy.load_state_dict(load_file(str(path)), strict=False)
    return policy.eval()


def probe_prompts(cfg, policy) -> tuple[list[str], dict | None]:
    """The run's training prompts (what its prompt stream holds: the files read as ``train``
    reads them, those the policy cannot read dropped) and their metadata table."""
    from maskgrpo_ray.cli.app import preflight
    from maskgrpo_ray.prompts.loading import keep_valid_prompts

    read = preflight(cfg)
    texts, _ = keep_valid_prompts([r.text for r in read.train], lambda p: policy.tokenize([p]))
    table = {r.text: r.meta for r in (*read.train, *read.eval) if r.meta}
    return texts, table or None


def measure(cfg, policy, spec):
    """The step signal of ``policy`` on ``spec``'s probe batches: each generated with its seed,
    scored with the config's reward, measured as a run's probe measures (``StepSignal``)."""
    from maskgrpo_ray.loop.step_signal_probe import measure as measure_signal
    from maskgrpo_ray.loop.step_signal_probe import probe_batches
    from maskgrpo_ray.pipeline.build import build_reward_from_settings
    from maskgrpo_ray.pipeline.phases import generate, score
    from maskgrpo_ray.pipeline.settings import advantage_settings, settings_from_config

    s = settings_from_config(cfg)
    reward = build_reward_from_settings(s.reward)
    prompts, meta = probe_prompts(cfg, policy)
    scored = []
    for ch in spec.chunks(prompts):
        rb = generate(
            policy,
            ch.prompts,
            ch.positions,
            policy_version=0,
            generator=torch.Generator().manual_seed(ch.seed),
            **s.rollout.kwargs(),
        )
        scored.append(score(reward, rb, meta))
    real, shuffled = probe_batches(scored, spec, advantage_settings(cfg))
    return measure_signal(policy, real, shuffled, s.update)


def as_results(signal) -> dict[str, list[float]]:
    """The bench's JSON keys (``cos_real``, ``cos_shuffled``, their ``_se``, the norms)."""
    return {
        "cos_real": signal.cos,
        "cos_real_se": signal.cos_se,
        "cos_shuffled": signal.floor,
        "cos_shuffled_se": signal.floor_se,
        "norm_real": signal.norm,
        "norm_shuffled": signal.norm_floor,
    }


def main() -> None:
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.loop.step_signal_probe import ProbeSpec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "toy.yaml"))
    ap.add_argument("--batches", type=int, default=None, help="K (default 12; a probe's K)")
    ap.add_argument("--prompts-per-batch", type=int, default=None, help="P (default B)")
    ap.add_argument("--after-steps", default="0,40")
    ap.add_argument("--checkpoint", default=None, help="measure these weights instead")
    ap.add_argument("--probe-step", type=int, default=None, help="a run probe's batches")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_step_signal.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(a.config, a.overrides)
    t = cfg.train
    if a.probe_step is not None:
        k = a.batches or t.step_signal_batches
        p = a.prompts_per_batch or t.step_signal_prompts_per_batch or t.prompts_per_step
        spec = ProbeSpec.of_run(cfg.run.seed, a.probe_step, k, p)
    else:
        spec = ProbeSpec.bench(a.batches or 12, a.prompts_per_batch or t.prompts_per_step)
    if a.checkpoint is not None:
        policies = {Path(a.checkpoint).name: policy_of(cfg, Path(a.checkpoint))}
    else:
        after = [int(x) for x in a.after_steps.split(",")]
        policies = {str(w): _policy_after(Path(a.config), a.overrides, w) for w in after}
    results = {}
    for name, policy in policies.items():
        m = as_results(measure(cfg, policy, spec))
        results[name] = m
        print(f"{name}: step | cos real (se) | cos shuffled (se) | |g| real | |g| shuffled")
        for t_ in range(len(m["cos_real"])):
            print(
                f"  {t_:3d} | {m['cos_real'][t_]:+.4f} ({m['cos_real_se'][t_]:.4f}) | "
                f"{m['cos_shuffled'][t_]:+.4f} ({m['cos_shuffled_se'][t_]:.4f}) | "
                f"{m['norm_real'][t_]:.4f} | {m['norm_shuffled'][t_]:.4f}",
                flush=True,
            )
    Path(a.out).write_text(
        json.dumps(
            {
                "config": a.config,
                "overrides": a.overrides,
                "batches": spec.batches,
                "prompts_per_batch": spec.prompts_per_batch,
                "probe_step": a.probe_step,
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
