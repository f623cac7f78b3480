"""The GenEval-shaped world's own figures: the judge's exactness, the reward model's agreement
with the judge, and the base model per tag with its diversity.

    .venv/bin/python -m bench.shapes_world [--config configs/shapes.yaml] [--samples 32]
        [--weights RUN/final_policy.safetensors] [--out bench/results_shapes_world.json]

* **Detector exactness**: on ``--renders`` random scenes of every tag, the share whose detected
  objects (class, colour, box) equal the drawn ones, on the renders and on their tokenizer round
  trip (render -> tokens -> pixels); the share of near misses (one thing wrong that the tag
  tests) the judge fails; the share of renders with one object malformed (a token blanked,
  filled solid or taken from another shape) where the judge finds a malformed object.
* **The reward against the judge**: how often the reward model ranks a correct image above a
  wrong one of the same prompt, on renders (near misses, malformed objects) and on the model's
  own samples (every pair of one prompt's samples where the judge calls one correct and the
  other wrong).
* **The model per tag** (the base, or ``--weights``): GenEval's overall and each tag on the
  held-out prompts under the evaluation sampler, with ``--samples`` images per prompt; its
  diversity per prompt: the mean pairwise ``1 - cos`` in the judge's layout embedding (the
  dominant colour of every token: not the reward's embedding), the same in the reward model's
  embedding, and the share of distinct detected layouts.
* **The diversity a correct policy keeps** (``reference_diversity``): the same pairwise figure on
  ``--samples`` correct scenes per held-out prompt drawn by the world's own sampler: what a
  policy that is always right, spread as the pre-training data is, would show.

``--picture RUN --picture-out PNG`` instead puts a run's per-tag grids side by side (the base
model's ``samples/eval_tags_base.png`` and the tuned one's ``eval_tags_final.png``, the same
seed): the README's picture.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

from maskgrpo_ray.algo.diversity import mean_pairwise_distance  # noqa: E402
from maskgrpo_ray.worlds.shapes import judge, pretrain, scenes, tokenizer  # noqa: E402
from maskgrpo_ray.worlds.shapes.reward_model import agreement, malform, score  # noqa: E402


def detector_figures(world, codebook: torch.Tensor, n: int, seed: int = 7) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    g, p = world.grid, world.patch_px
    prompts = pretrain.tag_balanced_prompts(rng, n)
    objs = [scenes.sample_scene(q, g, rng, p) for q in prompts]
    renders = np.stack([scenes.render(o, g, p) for o in objs])
    round_trip = tokenizer.decode(tokenizer.encode(renders, codebook), codebook, g)

    def agree(images: torch.Tensor) -> float:
        found = judge.detect(images, p)
        want = [
            sorted(
                (o.cls, o.colour, (o.row * p + 1, o.col * p + 1, o.size * p - 2, o.size * p - 2))
                for o in s
            )
            for s in objs
        ]
        return float(
            np.mean([sorted((d.cls, d.colour, d.box) for d in f) == w for f, w in zip(found, want)])
        )

    metas = [q.metadata() for q in prompts]
    wrong = np.stack(
        [scenes.render(scenes.corrupt_scene(q, o, g, rng, p), g, p) for q, o in zip(prompts, objs)]
    )
    bad = np.stack(
        [scenes.PALETTE[malform(scenes.render_indices(o, g, p), o, p, rng)] for o in objs]
    )
    return {
        "renders": n,
        "agreement_renders": agree(torch.from_numpy(renders)),
        "agreement_round_trip": agree(round_trip),
        "round_trip_exact": float((round_trip.numpy() == renders).all(axis=(1, 2, 3)).mean()),
        "correct_on_renders": float(
            judge.judge(torch.from_numpy(renders), metas, p)["geneval"].mean()
        ),
        "near_misses_failed": float(
            1 - judge.judge(torch.from_numpy(wrong), metas, p)["geneval"].mean()
        ),
        "malformed_found": float(
            (judge.judge(torch.from_numpy(bad), metas, p)["malformed"] > 0).float().mean()
        ),
        "codebook_size": int(codebook.shape[0]),
    }


def sample(policy, prompts: list[scenes.Prompt], k: int, cfg) -> torch.Tensor:
    """``k`` images per prompt under the evaluation sampler: uint8 ``[P * k, H, W, 3]``."""
    from maskgrpo_ray.algo.sampling import rollout

    e = cfg.eval
    w = cfg.rollout.guidance_scale if e.guidance_scale is None else e.guidance_scale
    gum = cfg.rollout.gumbel_temperature if e.gumbel_temperature is None else e.gumbel_temperature
    steps = e.unmasking_steps or cfg.rollout.unmasking_steps
    gen = torch.Generator().manual_seed(2024)
    out = []
    for q in prompts:
        with torch.no_grad():
            cond = policy.tokenize([q.text] * k)
            init = torch.full((k, policy.num_image_tokens), policy.codebook_size)
            t = rollout(policy.conditioned(cond, w), init, policy.codebook_size, num_steps=steps,
                        temperature=cfg.rollout.temperature, gumbel_temperature=gum, generator=gen,
                        record_likelihood=False)  # fmt: skip
            out.append(policy.decode_images(t.final_tokens))
    return torch.cat(out)


def reference_diversity(world, prompts: list[scenes.Prompt], k: int, seed: int = 11) -> dict:
    """The diversity a policy that is always right could keep: ``k`` correct scenes per prompt
    drawn by the world's own sampler (``scenes.sample_scene``: what the prompt leaves open drawn
    at random, as in pre-training), rendered, and measured as the model is (the mean pairwise
    ``1 - cos`` in the judge's layout embedding), overall and per tag. Set against the base's
    ``pairwise_layout``: above it, learning to be right need not cost diversity in this world."""
    rng = np.random.default_rng(seed)
    g, p = world.grid, world.patch_px
    per_tag: dict[str, list[float]] = {}
    for q in prompts:
        imgs = np.stack([scenes.render(scenes.sample_scene(q, g, rng, p), g, p) for _ in range(k)])
        d = mean_pairwise_distance(judge.layout_features(torch.from_numpy(imgs), p), k)
        per_tag.setdefault(q.tag, []).append(float(d.mean()))
    everything = [v for vs in per_tag.values() for v in vs]
    return {
        "samples": k,
        "pairwise_layout": statistics.fmean(everything),
        "tags": {t: statistics.fmean(v) for t, v in per_tag.items()},
    }


def model_figures(policy, reward, prompts, images: torch.Tensor, k: int, patch_px: int) -> dict:
    metas = [q.metadata() for q in prompts for _ in range(k)]
    texts = [q.text for q in prompts for _ in range(k)]
    correct = judge.judge(images, metas, patch_px)["geneval"].view(len(prompts), k)
    r = score(reward, images, texts).view(len(prompts), k)
    per_tag: dict[str, list[float]] = {}
    wins = pairs = 0
    for i, q in enumerate(prompts):
        per_tag.setdefault(q.tag, []).append(float(correct[i].mean()))
        good, bad = r[i][correct[i] > 0], r[i][correct[i] == 0]
        wins += int((good[:, None] > bad[None, :]).sum())
        pairs += good.numel() * bad.numel()
    layout = mean_pairwise_distance(judge.layout_features(images, patch_px), k)
    rew = mean_pairwise_distance(reward.encode_image(images).detach(), k)
    dets = judge.detect(images, patch_px)
    distinct = [
        len({judge.layout_key(d) for d in dets[i * k : (i + 1) * k]}) / k
        for i in range(len(prompts))
    ]
    tags = {t: statistics.fmean(v) for t, v in per_tag.items()}
    return {
        "overall": statistics.fmean(tags.values()),
        "tags": tags,
        "reward_ranks_correct_above_wrong": wins / pairs if pairs else float("nan"),
        "pairs": pairs,
        "pairwise_layout": float(layout.mean()),
        "pairwise_reward_embedding": float(rew.mean()),
        "distinct_layouts": statistics.fmean(distinct),
        "malformed_per_image": float(judge.judge(images, metas, patch_px)["malformed"].mean()),
    }


def picture(run: Path, out: Path) -> None:
    """``RUN/samples/eval_tags_base.png`` | ``eval_tags_final.png`` -> one PNG, titled."""
    from PIL import Image, ImageDraw

    base, final = (Image.open(run / "samples" / f"eval_tags_{n}.png") for n in ("base", "final"))
    label = 260  # save_sample_grid's prompt column: kept on the left panel only
    right = final.crop((label, 0, final.width, final.height))
    img = Image.new("RGB", (base.width + 16 + right.width, base.height + 22), "white")
    img.paste(base, (0, 22))
    img.paste(right, (base.width + 16, 22))
    d = ImageDraw.Draw(img)
    d.text((label + 4, 4), "base model", fill="black")
    d.text((base.width + 20, 4), "after Mask-GRPO (configs/shapes.yaml)", fill="black")
    img.save(out)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "shapes.yaml"))
    ap.add_argument("--samples", type=int, default=32, help="images per held-out prompt")
    ap.add_argument("--renders", type=int, default=2000)
    ap.add_argument("--weights", default=None, help="a tuned policy instead of the base")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_shapes_world.json"))
    ap.add_argument("--picture", default=None, help="a run folder: its per-tag grids side by side")
    ap.add_argument("--picture-out", default=str(ROOT / "docs" / "img" / "shapes_tags.png"))
    a = ap.parse_args()
    if a.picture:
        picture(Path(a.picture), Path(a.picture_out))
        return
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.pipeline.build import build_policy
    from maskgrpo_ray.worlds.shapes.model import policy_spec, reward_spec
    from maskgrpo_ray.worlds.shapes.reward_model import load_or_train

    torch.set_num_threads(1)
    cfg = load_config(a.config)
    t0 = time.perf_counter()
    policy = build_policy(cfg.model).eval()
    reward = load_or_train(reward_spec(cfg.model.shapes))
    if a.weights:
        from safetensors.torch import load_file

        policy.load_state_dict(load_file(a.weights), strict=False)
    world = policy_spec(cfg.model.shapes).world
    out: dict = {"config": _portable(a.config), "weights": _portable(a.weights) or "base"}
    out["detector"] = detector_figures(world, policy.codebook, a.renders)
    out["reward_on_renders"] = agreement(reward, n=1024)
    _, held = scenes.split_prompts()
    images = sample(policy, list(held), a.samples, cfg)
    out["model"] = model_figures(policy, reward, list(held), images, a.samples, world.patch_px)
    out["reference_diversity"] = reference_diversity(world, list(held), a.samples)
    out["seconds"] = time.perf_counter() - t0
    print(json.dumps(out, indent=1))
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


def _portable(path: str | None) -> str | None:
    """A path as a results file records it: relative to the repository when inside it, else
    its last two parts (a run folder and a file): no machine's absolute path in tracked files."""
    if not path:
        return path
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(Path(*p.parts[-2:]))


if __name__ == "__main__":
    main()
