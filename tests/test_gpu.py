"""The rollout and the learner's recomputation on CUDA (``gpu`` marker: skipped without CUDA).

The sampler's draws (``multinomial`` and the Gumbel uniforms) must use a generator on the
logits' device; before the fix the Gumbel uniforms were drawn on a CPU tensor with the CUDA
generator, which PyTorch rejects. These tests run a whole rollout on the GPU with Show-o's noisy
remasking (tau_0 = 1) and recompute every (sample, step) log-prob as the learner does, in
float32: the log-ratio at the first update must be ~0 (TF32 matmuls are off here; the spread is
printed, as the ``abs_log_ratio_*`` metrics report it in training).
"""

from __future__ import annotations

import pytest
import torch

from maskgrpo_ray.algo.estimators import ForwardSettings
from maskgrpo_ray.algo.sampling import check_generator_device
from maskgrpo_ray.pipeline.learner_loss import abs_log_ratio_stats, pair_log_probs, train_pairs
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.pipeline.phases import generate
from maskgrpo_ray.worlds.toy.model import ToyModelSpec, ToyPolicy

PROMPTS = ["two red dots on the left", "one blue dot on the top", "three green dots"]


def _rollout_and_recompute(
    policy, transition: str, likelihood: str, steps: int, forward=None, sampler="showo"
):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rb = generate(
        policy,
        PROMPTS,
        [0, 1, 2],
        group_size=4,
        num_steps=steps,
        temperature=1.0,
        gumbel_temperature=1.0,
        guidance_scale=0.0,
        transition=transition,
        policy_version=0,
        generator=gen,
        remask_likelihood=likelihood,
        sampler=sampler,
        forward=forward,
    )
    batch = TrainBatch.from_rollout(rb, torch.zeros(rb.num_samples))
    samples, steps_ = train_pairs(batch, torch.arange(batch.old_logp.shape[1]))
    with torch.no_grad():
        logp = torch.cat(
            [
                pair_log_probs(policy, batch, samples[i : i + 16], steps_[i : i + 16]).cpu()
                for i in range(0, len(samples), 16)
            ]
        )
    abs_lr = (logp - batch.old_logp[samples, steps_]).abs()
    return abs_lr, steps_


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("transition", "likelihood"), [("p1", "marginal"), ("p1", "eq14"), ("p2", "marginal")]
)
def test_toy_rollout_on_cuda_matches_the_learners_recompute(transition, likelihood):
    torch.manual_seed(0)
    policy = ToyPolicy(ToyModelSpec(grid=4, d_model=32, layers=1)).cuda().eval()
    abs_lr, steps = _rollout_and_recompute(policy, transition, likelihood, steps=6)
    print(transition, likelihood, abs_log_ratio_stats(abs_lr, steps))
    assert float(abs_lr.max()) < 1e-3


@pytest.mark.gpu
def test_tiny_showo_rollout_on_cuda_matches_the_learners_recompute():
    from maskgrpo_ray.models.showo import build_tiny_random_policy

    policy = build_tiny_random_policy(seed=3, max_text_len=16).cuda().eval()
    abs_lr, steps = _rollout_and_recompute(policy, "p1", "marginal", steps=4)
    print("tiny show-o", abs_log_ratio_stats(abs_lr, steps))
    assert float(abs_lr.max()) < 1e-3


def test_a_cpu_generator_for_cuda_logits_is_named():
    # runs without CUDA: only the devices' types are compared
    with pytest.raises(ValueError, match="generator is on cpu but the logits are on cuda"):
        check_generator_device(torch.Generator(), torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("rule", "sampler"), [("stratified", "showo"), ("step_focus", "ancestral")]
)
def test_forward_estimator_on_cuda_matches_the_learners_recompute(rule, sampler):
    """The seeded masks (built on the CPU) give the rollout's and the learner's CUDA forwards
    the same states: the log-ratio before the first update is ~0."""
    from maskgrpo_ray.models.showo import build_tiny_random_policy

    fwd = ForwardSettings(
        num_draws=3, ratio_min=0.3, ratio_max=1.0, ratio_rule=rule, reduction="mean"
    )
    policy = build_tiny_random_policy(seed=3, max_text_len=16).cuda().eval()
    abs_lr, steps = _rollout_and_recompute(policy, "p2", "marginal", 4, fwd, sampler)
    print("forward", rule, sampler, abs_log_ratio_stats(abs_lr, steps))
    assert float(abs_lr.max()) < 1e-3
