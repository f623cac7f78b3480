"""The embedded default's promise, on three seeds: every one learns (held-out accuracy up by
>= 0.35 to >= 0.75) and keeps more than one image per prompt (distinct >= 0.03 of 32).

On the machine that chose the default, seeds 0-4 end in the README's range; another machine's
float rounding takes a seed elsewhere, so the floors leave room. The diversity floor is what the
default holds, not what one would want: a prompt's 32 samples collapse onto about two images
(docs/diversity.md says why, and what trades accuracy for diversity).
"""

from __future__ import annotations

import json

import pytest

from maskgrpo_ray.cli import main


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_default_learns_on_every_seed(tmp_path, seed):
    run = tmp_path / "run"
    args = ["train", "--backend", "local", "--run-dir", str(run)]
    for s in ("logging.progress_bar=false", f"run.seed={seed}", "run.export_final_policy=false"):
        args += ["--set", s]
    assert main(args) == 0
    s = json.loads((run / "summary.json").read_text())
    # same eval prompts and seeds before and after; 24 held-out captions x 32 samples each
    assert s["final_accuracy"] - s["base_accuracy"] >= 0.35, s
    assert s["final_accuracy"] >= 0.75, s
    assert s["final_eval"]["eval_diversity/distinct"] >= 0.03, s["final_eval"]
    assert s["wall_seconds"] < 600, s
