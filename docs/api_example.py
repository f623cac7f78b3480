"""The Python API, cell by cell (docs/api.md): train the toy world, evaluate base against tuned,
plan a GPU split. Runs anywhere the package is installed, in about a minute on 2 CPU cores (the toy's
base model is pre-trained once, under a minute, and cached in ~/.cache/maskgrpo-ray):

    python docs/api_example.py [WORK_DIR]          # default: a temporary folder

``tests/test_api.py`` runs it and checks what it prints.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import maskgrpo_ray as mg

logging.basicConfig(level=logging.WARNING)  # INFO shows the commands' progress lines
work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="maskgrpo-api-"))

# %% A config: a built-in name (maskgrpo configs list), a YAML file or a dict, plus overrides.
small = {
    "run.backend": "local",  # the single-process baseline; "ray" starts a local Ray cluster
    "train.steps": 6,
    "train.prompts_per_step": 4,
    "rollout.unmasking_steps": 4,
    "eval.samples_per_prompt": 2,
    "eval.every_steps": 0,
    "logging.progress_bar": False,
    "logging.sample_grid_every_steps": 0,
}
cfg = mg.load_config("toy", small)
print(
    f"config: {cfg.model.kind} model, G={cfg.rollout.samples_per_prompt}, B={cfg.train.prompts_per_step}"
)

# %% Train: maskgrpo train's own path (hub ids resolved, prompts checked, resume), a summary back.
summary = mg.train(cfg, run_dir=work / "run")
print(
    f"trained {summary['steps']} steps in {summary['wall_seconds']:.0f} s: held-out reward "
    f"{summary['base_reward']:.3f} -> {summary['final_reward']:.3f}, accuracy "
    f"{summary['base_accuracy']:.3f} -> {summary['final_accuracy']:.3f}"
)
print(f"run directory: {summary['run_dir']}")

# %% Evaluate the base model against the tuned weights: images, metrics, report.md / .html.
report = mg.evaluate(["base", summary["run_dir"]], samples_per_prompt=2, out=work / "eval")
for label, means in report["means"].items():
    print(f"eval {label}: accuracy {means['accuracy']:.3f}, reward {means['reward']:.3f}")
print(f"report: {Path(report['out']) / 'report.md'}")

# %% Plan: the rollout/learner split of 16 H100s for Show-o 512 px (a cost model).
split = mg.plan("showo_512_h100", gpus=16)
best = split["recommended"]
print(
    f"plan: {best['rollout_gpus']} rollout + {best['learner_gpus']} learner GPUs, "
    f"{split['images_per_s']:.2f} img/s predicted"
)
