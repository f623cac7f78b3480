"""bench_gpu's rollout sections: images/s of ``phases.generate`` per batch size and likelihood
(section 1, **rollout**), and the first update's ``|log pi - log pi_old|`` (section 2, **fidelity**)."""

from __future__ import annotations

from typing import Any

import torch

from bench.gpu_common import (
    BUDGET_S,
    CONFIG,
    FIDELITY_KINDS,
    GROUP_SIZE,
    LIKELIHOODS,
    Bench,
    SectionClock,
    Shape,
    fresh_memory,
    measure,
    peak_gib,
    print_table,
    timed_call,
)
from maskgrpo_ray.pipeline.learner_loss import abs_log_ratio_stats, pair_log_probs, train_pairs
from maskgrpo_ray.pipeline.messages import RolloutBatch, TrainBatch
from maskgrpo_ray.pipeline.phases import generate


def rollout(b: Bench, shape: Shape, n: int, lik: str, transition: str = "p1") -> RolloutBatch:
    """``n / G`` distinct prompts x ``G`` samples through ``phases.generate``, with the
    sampler of ``configs/showo_256_clip.yaml`` at this shape's ``S``."""
    prompts = [f"a photo of object number {i} on a table" for i in range(n // GROUP_SIZE)]
    kwargs = CONFIG.rollout.kwargs() | {"num_steps": shape.num_steps, "transition": transition}
    return generate(
        b.policies[shape.name],
        prompts,
        list(range(len(prompts))),
        **kwargs | {"remask_likelihood": lik},
        policy_version=0,
        generator=torch.Generator(device=b.device).manual_seed(b.args.seed + n),
    )


def first_group(rb: RolloutBatch) -> RolloutBatch:
    return rb.group_slice(torch.arange(len(rb.prompts)) == 0)


def group_rollout(b: Bench, shape: Shape, lik: str) -> RolloutBatch:
    """One group at the initial weights: kept by the rollout section, else made now."""
    key = (shape.name, lik)
    if key not in b.group_rollouts:
        b.group_rollouts[key] = rollout(b, shape, GROUP_SIZE, lik)
    return b.group_rollouts[key]


def rollout_config(
    b: Bench, clock: SectionClock, shape: Shape, n: int, lik: str, warmup: bool
) -> dict[str, Any]:
    """Time ``generate`` at one (shape, likelihood, N); keep its first group for later."""
    b.say(f"rollout {shape.name} {lik} N={n}")
    fresh_memory(b.device)
    out: list[RolloutBatch] = []
    policy = b.policies[shape.name]
    try:
        timing = measure(lambda: out.append(rollout(b, shape, n, lik)), b, clock, warmup=warmup)
        decode_s = timed_call(lambda: policy.decode_images(out[-1].final_tokens), b.device)[0]
    except torch.OutOfMemoryError:
        out.clear()
        return {"skipped": "out of memory"}
    b.group_rollouts.setdefault((shape.name, lik), first_group(out[-1]))
    sec = timing["seconds"]
    flops = b.flops.forward(shape.num_image_tokens, n * shape.num_steps, n // GROUP_SIZE)
    row = timing | {"images_per_s": n / sec, "decode_s": decode_s, "decode_share": decode_s / sec}
    row |= {"tflops_per_s": flops / sec / 1e12, "mfu": b.mfu(flops, sec)}
    return row | {"peak_mem_gib": peak_gib(b.device)}


def bench_rollout(b: Bench) -> dict[str, Any]:
    clock = SectionClock(BUDGET_S["rollout"] * b.args.budget_scale)
    rows: list[dict[str, Any]] = []
    per_image: dict[tuple[str, str], float] = {}  # seconds per image of the last config
    for shape in b.shapes():
        for n in b.args.batch_sizes:
            for lik in LIKELIHOODS:
                key = (shape.name, lik)
                row: dict[str, Any] = {"shape": shape.name, "likelihood": lik, "N": n}
                row |= {"L": shape.num_image_tokens, "S": shape.num_steps}
                if key in per_image and not clock.fits(per_image[key] * n):
                    rows.append(row | {"skipped": "time budget"})
                    continue
                row |= rollout_config(b, clock, shape, n, lik, warmup=key not in per_image)
                if "seconds" in row:
                    per_image[key] = row["seconds"] / n
                rows.append(row)
    ratio_to_eq14(rows, "N")
    print_table(
        "rollout: phases.generate, p1, G=6, guidance 0 (time includes the MAGVIT decode)",
        ["shape", "likelihood", "N", "S", "seconds", "images_per_s", "time_vs_eq14"]
        + ["decode_share", "tflops_per_s", "mfu", "peak_mem_gib", "repeats"],
        rows,
    )
    return {"rows": rows}


def ratio_to_eq14(rows: list[dict[str, Any]], key: str) -> None:
    """``time_vs_eq14``: a row's time over the Eq. 14 row's at the same shape and ``key``."""
    base = {(r["shape"], r[key]): r.get("seconds") for r in rows if r["likelihood"] == "eq14"}
    for row in rows:
        eq14 = base.get((row["shape"], row[key]))
        if "seconds" in row and eq14:
            row["time_vs_eq14"] = row["seconds"] / eq14


def bench_fidelity(b: Bench) -> dict[str, Any]:
    """The rollout's ``old_logp`` vs the learner's recomputation before any update."""
    clock = SectionClock(BUDGET_S["fidelity"] * b.args.budget_scale)
    rows: list[dict[str, Any]] = []
    mb = b.args.fidelity_micro_batch
    for shape in b.shapes():
        for kind, lik in FIDELITY_KINDS:
            name = f"{kind} {lik}" if kind == "p1" else kind
            if not clock.fits(0.0):
                rows.append({"shape": shape.name, "kind": name, "skipped": "time budget"})
                continue
            b.say(f"fidelity {shape.name} {kind} {lik}")
            if kind == "p1":
                rb = group_rollout(b, shape, lik)
            else:
                rb = first_group(rollout(b, shape, GROUP_SIZE, lik, transition=kind))
            batch = TrainBatch.from_rollout(rb, torch.zeros(rb.num_samples))
            samples, steps = train_pairs(batch, torch.arange(shape.num_steps))
            with torch.no_grad():
                logp = torch.cat(
                    [
                        pair_log_probs(b.policies[shape.name], batch, s, t).cpu()
                        for s, t in zip(samples.split(mb), steps.split(mb))
                    ]
                )
            old = batch.old_logp[samples, steps]
            stats = abs_log_ratio_stats((logp - old).abs(), steps)
            rows.append(
                {"shape": shape.name, "kind": name}
                | {"pairs": len(samples), "micro_batch": mb}
                | {k.removeprefix("abs_log_ratio_"): v for k, v in stats.items()}
                | {"mean_abs_old_logp": float(old.abs().mean())}
            )
    print_table(
        f"fidelity: first-update |log pi - log pi_old| (nats), rollout (batch N=6) vs "
        f"pair_log_probs (micro-batches), {b.args.dtype}",
        ["shape", "kind", "pairs", "micro_batch", "mean", "p90", "max", "worst_step"]
        + ["mean_abs_old_logp"],
        rows,
    )
    return {"rows": rows, "dtype": b.args.dtype}
