"""Live scaling: `maskgrpo scale` reaches a running executor through its control actor; the
new rollout actor takes work at the next step, no prompt is lost or trained twice."""

from __future__ import annotations

import os

import pytest

from maskgrpo_ray.cli import main
from maskgrpo_ray.config import load_config
from maskgrpo_ray.loop import driver
from maskgrpo_ray.pipeline.settings import step_settings
from maskgrpo_ray.prompts.loading import PromptStream, load_prompts

TOY = os.path.join(os.path.dirname(__file__), "..", "configs", "toy.yaml")
SMALL = [
    "train.prompts_per_step=8",
    "rollout.unmasking_steps=4",
    "rollout.num_actors=1",
    "rollout.prompts_per_chunk=2",
    "reward.num_actors=1",
    "learner.num_workers=1",
    "rollout.num_cpus_per_actor=0.25",
    "reward.num_cpus_per_actor=0.25",
    "learner.num_cpus_per_worker=0.25",
    "logging.progress_bar=false",
    "filter.enabled=false",
    "run.name=scaletest",
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_scale_command_adds_a_rollout_actor_at_the_next_step(ray_cluster, capsys):
    from maskgrpo_ray.backend.ray_executor import RayExecutor

    cfg = load_config(TOY, SMALL)
    ex = RayExecutor(cfg, timeout_s=300)
    try:
        stream = PromptStream(load_prompts("toy"), seed=0)
        source = driver.make_source(ex, cfg, stream)
        rows, trained = [], []

        def step(i):
            positions = list(range(stream.position, stream.position + cfg.train.prompts_per_step))
            out, _ = driver.run_step(ex, step_settings(cfg), i, source)
            assert out.scored.rollout.prompt_indices == positions  # every prompt once, in order
            trained.extend(out.scored.rollout.prompt_indices)
            ex.on_step_end(i, out.row)
            rows.append(out.row)

        step(0)
        step(1)
        assert ex.fleet.rollout_actor_ids() == [0]
        assert main(["status", "--run", "scaletest"]) == 0
        assert '"step": 1' in capsys.readouterr().out
        assert main(["scale", "--run", "scaletest", "--rollout", "2"]) == 0
        assert len(ex.fleet.rollout_actor_ids()) == 1  # nothing changes mid-step
        step(2)  # its on_step_end applies the request
        assert ex.fleet.rollout_actor_ids() == [0, 1]
        before = dict(ex.chunks_by_actor)
        step(3)
        step(4)
        assert ex.chunks_by_actor.get(1, 0) - before.get(1, 0) > 0  # the new actor took work
        assert len(trained) == len(set(trained)) == 5 * cfg.train.prompts_per_step
        assert rows[-1]["rollout_actors"] == 2.0
        print(
            f"samples/s with 1 rollout actor: {rows[1]['samples_per_second']:.1f}, "
            f"with 2: {rows[4]['samples_per_second']:.1f}"
        )
        assert main(["scale", "--run", "scaletest", "--rollout", "0"]) == 2
        assert main(["scale", "--run", "no-such-run", "--rollout", "2"]) == 2
    finally:
        ex.shutdown()
