"""bench_gpu's learner sections: (sample, step) pairs/s of ``learner_core.apply_update`` per
micro-batch (section 3, **learner**) and the model FLOPs per second against the device's peak
(section 4, **mfu**)."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import torch

from bench.gpu_common import (
    BUDGET_S,
    CONFIG,
    GROUP_SIZE,
    LIKELIHOODS,
    Bench,
    SectionClock,
    Shape,
    fresh_memory,
    measure,
    peak_gib,
    print_table,
)
from bench.gpu_rollout import group_rollout, ratio_to_eq14
from maskgrpo_ray.pipeline.learner_core import (
    TorchOptimizing,
    UpdatePlan,
    apply_update,
    build_optimizer,
)
from maskgrpo_ray.pipeline.learner_loss import train_pairs
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.pipeline.settings import UpdateSettings


def update_settings(shape: Shape, micro_batch: int) -> UpdateSettings:
    """The update of ``configs/showo_256_clip.yaml`` (clip 0.1/0.2, guards, gradient clip,
    AdamW) at this shape's ``S``, one optimizer step per batch."""
    return replace(CONFIG.update, num_steps=shape.num_steps, micro_batch_pairs=micro_batch)


def text_prefixes(batch: TrainBatch, plan: UpdatePlan, micro_batch: int) -> int:
    """Text prefixes the learner computes: the distinct prompts of each micro-batch, summed."""
    samples, _ = train_pairs(batch, plan.train_steps)
    chunks = samples.split(micro_batch)
    return sum(int(torch.unique(batch.cond_ids[c], dim=0).shape[0]) for c in chunks)


def learner_config(
    b: Bench, clock: SectionClock, shape: Shape, opt: TorchOptimizing, batch: TrainBatch, mb: int
) -> dict[str, Any]:
    """Time ``apply_update`` on ``batch`` at micro-batch ``mb`` (one warm-up update first)."""
    k = min(b.args.learner_steps, shape.num_steps)
    steps = torch.linspace(0, shape.num_steps - 1, k).round().long().unique()
    plan = UpdatePlan(steps, learning_rate=CONFIG.update.learning_rate)
    settings = update_settings(shape, mb)
    pairs = batch.num_samples * len(steps)
    fresh_memory(b.device)
    try:
        timing = measure(lambda: apply_update(opt, batch, plan, settings), b, clock, warmup=True)
    except torch.OutOfMemoryError:
        opt.zero_grad()
        return {"pairs": pairs, "skipped": "out of memory"}
    sec, prefixes = timing["seconds"], text_prefixes(batch, plan, mb)
    flops = 3 * b.flops.forward(shape.num_image_tokens, pairs, prefixes)
    row = timing | {"pairs": pairs, "pairs_per_s": pairs / sec, "text_prefixes": prefixes}
    row |= {"tflops_per_s": flops / sec / 1e12, "mfu": b.mfu(flops, sec)}
    return row | {"peak_mem_gib": peak_gib(b.device)}


def bench_learner(b: Bench) -> dict[str, Any]:
    clock = SectionClock(BUDGET_S["learner"] * b.args.budget_scale)
    rows: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(b.args.seed)
    first = b.policies[b.shapes()[0].name]
    optimizer = build_optimizer(update_settings(b.shapes()[0], 1), first)  # weights are shared
    for shape in b.shapes():
        opt = TorchOptimizing(b.policies[shape.name], optimizer, grad_clip_norm=0.0)
        for lik in LIKELIHOODS:
            adv = torch.randn(GROUP_SIZE, generator=gen)
            batch = TrainBatch.from_rollout(group_rollout(b, shape, lik), adv - adv.mean())
            per_call = None  # seconds of the last apply_update
            for mb in b.args.micro_batches:
                row: dict[str, Any] = {"shape": shape.name, "likelihood": lik, "micro_batch": mb}
                if per_call is not None and not clock.fits(2 * per_call):  # warm-up + 1 repeat
                    rows.append(row | {"skipped": "time budget"})
                    continue
                b.say(f"learner {shape.name} {lik} micro-batch {mb}")
                row |= learner_config(b, clock, shape, opt, batch, mb)
                per_call = row.get("seconds", per_call)
                rows.append(row)
        opt.zero_grad()
    ratio_to_eq14(rows, "micro_batch")
    print_table(
        "learner: apply_update (forward + backward + AdamW step), one group of G=6, p1",
        ["shape", "likelihood", "micro_batch", "pairs", "seconds", "pairs_per_s", "time_vs_eq14"]
        + ["tflops_per_s", "mfu", "peak_mem_gib", "repeats"],
        rows,
    )
    return {"rows": rows, "train_steps_per_sample": b.args.learner_steps}


def bench_mfu(b: Bench) -> dict[str, Any]:
    """The FLOP accounting, and the best throughput each phase reached per shape."""
    f, rows = b.flops, []
    for shape in b.shapes():
        for phase in ("rollout", "learner"):
            for lik in LIKELIHOODS:
                done = [
                    r["tflops_per_s"]
                    for r in b.results[phase]["rows"]
                    if r["shape"] == shape.name and r["likelihood"] == lik and "seconds" in r
                ]
                best = max(done, default=None)
                rows.append(
                    {"shape": shape.name, "phase": f"{phase} {lik}", "best_tflops_per_s": best}
                    | {"mfu": best * 1e12 / b.peak_flops if best and b.peak_flops else None}
                    | {"attention_uncounted": f.attention_share(shape.num_image_tokens)}
                )
    peak = f"{b.peak_flops / 1e12:g} TFLOP/s" if b.peak_flops else "unknown (--peak-tflops)"
    print_table(
        f"MFU: FLOPs = 2 x ({f.body_params:.4g} layer params x (L+2 image rows, + {f.text_len} "
        f"per text prefix) + {f.head_params:.4g} head params x L), x3 in the learner; "
        f"peak {peak}",
        ["shape", "phase", "best_tflops_per_s", "mfu", "attention_uncounted"],
        rows,
    )
    return {"flop_model": asdict(f), "peak_flops": b.peak_flops, "rows": rows}
