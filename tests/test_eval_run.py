"""``maskgrpo eval`` on the toy world: fixed-seed units, the same image bytes with 1 and 2
rollout actors, a base-vs-tuned report, and bad input that stops before any actor starts."""

from __future__ import annotations

import json
import os

import pytest
import ray
import torch

from maskgrpo_ray.cli import main
from maskgrpo_ray.config import load_config
from maskgrpo_ray.evaluation.generation import make_units, unit_seed
from maskgrpo_ray.evaluation.runner import LocalGenerator, RayGenerator
from maskgrpo_ray.pipeline.settings import settings_from_config
from maskgrpo_ray.prompts.loading import load_prompt_records

TOY = os.path.join(os.path.dirname(__file__), "..", "configs", "toy.yaml")
SMALL = [
    "eval.samples_per_prompt=2",
    "eval.prompts_per_unit=3",
    "rollout.unmasking_steps=4",
    "rollout.num_cpus_per_actor=0.25",
    "logging.progress_bar=false",
]


def cfg_with(*extra: str):
    return load_config(TOY, [*SMALL, *extra])


def test_units_cover_the_prompts_in_order_with_index_seeds():
    settings = settings_from_config(cfg_with()).eval
    units = make_units([f"p{i}" for i in range(8)], settings)
    assert [u.prompt_indices for u in units] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [u.seed for u in units] == [unit_seed(settings.seed, u) for u in range(3)]
    assert len({u.seed for u in units}) == 3


def test_same_image_bytes_with_one_and_two_rollout_actors(ray_cluster):
    cfg = cfg_with()
    settings = settings_from_config(cfg).eval
    prompts = [r.text for r in load_prompt_records("toy", "eval").records][:7]
    units = make_units(prompts, settings)
    local = LocalGenerator(cfg, settings).rollouts(units)
    per_count = {}
    for actors in (1, 2):
        gen = RayGenerator(cfg, actors, timeout_s=300)
        try:
            per_count[actors] = gen.rollouts(units)
        finally:
            gen.shutdown()
    for one, two, here in zip(per_count[1], per_count[2], local, strict=True):
        assert one.images.numpy().tobytes() == two.images.numpy().tobytes()
        assert one.images.numpy().tobytes() == here.images.numpy().tobytes()
    # and the images are not all alike (the seeds differ per unit)
    assert not torch.equal(per_count[1][0].images[:2], per_count[1][1].images[:2])


def tuned_file(tmp_path, cfg) -> str:
    """A weights file unlike the base model: the base weights, perturbed."""
    from safetensors.torch import save_file

    from maskgrpo_ray.pipeline.build import build_policy

    torch.manual_seed(1)
    policy = build_policy(cfg.model)
    state = {n: p.detach() + 0.5 * torch.randn_like(p) for n, p in policy.named_parameters()}
    path = tmp_path / "tuned.safetensors"
    save_file(state, str(path))
    return str(path)


def test_maskgrpo_eval_writes_report_layout_and_tables(tmp_path, capsys):
    cfg = cfg_with()
    out = tmp_path / "out"
    argv = ["eval", "--config", TOY, *sum((["--set", s] for s in SMALL), [])]
    argv += ["--backend", "local", "--weights", "base", "--weights", tuned_file(tmp_path, cfg)]
    argv += ["--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    means = report["means"]
    n_prompts = len(load_prompt_records("toy", "eval").records)
    assert set(means) == {"base", "tuned"}
    for label in ("base", "tuned"):
        assert {"reward", "accuracy", "geneval"} <= set(means[label])
        assert {"geneval/single_object", "geneval/counting"} <= set(means[label])
        # the toy GenEval rule and the toy reward's correctness agree image by image
        assert means[label]["geneval"] == pytest.approx(means[label]["accuracy"])
        layout = out / label / "images"
        assert len(list(layout.iterdir())) == n_prompts
        assert len(list((layout / "00000" / "samples").iterdir())) == 2
    assert means["base"]["reward"] != means["tuned"]["reward"]
    assert (out / "report.md").is_file()
    printed = capsys.readouterr().out
    assert "geneval/counting" in printed and "report:" in printed


def bad_input_cases(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    untagged = tmp_path / "meta.jsonl"
    lines = [
        {"tag": "single_object", "include": [{"class": "dot", "count": 1}], "prompt": "a"},
        {"include": [{"class": "dot", "count": 1}], "prompt": "b"},
    ]
    untagged.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "captions.parquet"
    pq.write_table(pa.table({"TEXT": ["one red dot on the left"]}), parquet)
    missing = tmp_path / "no_such_clip.bin"
    return [
        (["--prompts", str(empty)], [str(empty), "--prompts"]),
        (["--prompts", str(untagged)], [f"{untagged}:2", "'tag'"]),
        (["--prompts", str(parquet)], [str(parquet), "TEXT", "prompt_column"]),
        (
            ["--metric", f"kind=clip_score,model=ViT-B-32,weights={missing}"],
            [str(missing), "eval.metrics[0].weights"],
        ),
    ]


def test_bad_input_fails_before_any_actor_starts(tmp_path, capsys):
    if ray.is_initialized():
        ray.shutdown()
    for extra, needles in bad_input_cases(tmp_path):
        argv = ["eval", "--config", TOY, "--backend", "ray", "--out", str(tmp_path / "o"), *extra]
        assert main(argv) == 2, extra
        err = capsys.readouterr().err
        for needle in needles:
            assert needle in err, (extra, needle, err)
        assert not ray.is_initialized()  # nothing was started
        assert not (tmp_path / "o").exists()


def test_training_evaluation_reports_per_tag_figures():
    from maskgrpo_ray.evaluation.generation import evaluate_rewards
    from maskgrpo_ray.pipeline.build import build_policy, build_reward_from_settings

    cfg = cfg_with()
    settings = settings_from_config(cfg)
    records = load_prompt_records("toy", "eval").records[:10]
    prompts, tags = [r.text for r in records], [r.meta["tag"] for r in records]
    torch.manual_seed(cfg.run.seed)
    policy = build_policy(cfg.model)
    reward = build_reward_from_settings(settings.reward)
    out = evaluate_rewards(policy, reward, prompts, settings.eval, tags)
    plain = evaluate_rewards(policy, reward, prompts, settings.eval)
    assert out["eval_accuracy"] == plain["eval_accuracy"]  # tags only add keys
    # the overall mean is the prompt-weighted mean of the tag means (same samples per prompt)
    n = {t: tags.count(t) for t in set(tags)}
    assert set(n) == {"single_object", "counting"}
    weighted = sum(out[f"eval_reward/{t}"] * k for t, k in n.items()) / len(tags)
    assert out["eval_reward"] == pytest.approx(weighted, rel=1e-5)


def test_the_rewards_standard_error_counts_prompts_not_samples():
    """eval_reward_se: with the prompts known (tags), the SE over the prompts' means, so a
    prompt's correlated samples do not shrink it; without, over the samples; NaN skipped."""
    import math

    from maskgrpo_ray.evaluation.generation import mean_se, summarize

    # 3 prompts x 2 samples; each prompt's samples equal: the samples' SE would be too small
    x = torch.tensor([1.0, 1.0, 2.0, 2.0, 6.0, 6.0])
    assert mean_se(x, 3) == pytest.approx(float(torch.tensor([1.0, 2.0, 6.0]).std()) / 3**0.5)
    assert mean_se(x) == pytest.approx(float(x.std()) / 6**0.5)
    assert mean_se(x) < mean_se(x, 3)
    assert mean_se(torch.tensor([1.0, math.nan, 3.0])) == pytest.approx(
        1.0
    )  # sd 2**0.5 over 2**0.5
    assert math.isnan(mean_se(torch.tensor([1.0])))
    out = summarize([{"reward": x}], ["a", "a", "b"])
    assert out["eval_reward_se"] == pytest.approx(mean_se(x, 3))
    assert summarize([{"reward": x}])["eval_reward_se"] == pytest.approx(mean_se(x))
    assert "eval_accuracy_se" not in summarize([{"reward": x, "accuracy": x}])


def test_maskgrpo_eval_with_fid_against_a_reference_folder(tmp_path):
    from PIL import Image

    from maskgrpo_ray.evaluation.tiny import random_inception_file

    weights = random_inception_file(tmp_path / "inception.pth")
    ref = tmp_path / "ref"
    ref.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        arr = torch.randint(0, 256, (16, 16, 3), dtype=torch.uint8, generator=g).numpy()
        Image.fromarray(arr).save(ref / f"{i}.png")
    prompts = tmp_path / "p.txt"
    prompts.write_text(
        "one red dot on the left\ntwo blue dots on the top\none red dot on the left\n"
    )
    out = tmp_path / "out"
    argv = ["eval", "--config", TOY, *sum((["--set", s] for s in SMALL), [])]
    argv += ["--backend", "local", "--prompts", str(prompts), "--out", str(out)]
    argv += ["--metric", f"kind=fid,weights={weights},reference_dir={ref},kid_subset_size=4"]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["prompts_dropped"] == {"duplicate": 1}
    fid = report["set_metrics"]["base"]
    assert fid["fid"] > 0 and fid["kid_subset_size"] == 4  # 2 prompts x 2 samples = 4 images
    assert "geneval" not in report["means"]["base"]  # a plain text file has no metadata
