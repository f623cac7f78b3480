"""Show-o at full size on one GPU: rollout, learner, MFU, weight sync, first-update log-ratio.

The full-size architecture (Phi-1.5 transformer, 1.448e9 parameters, and the MAGVIT-v2
decoder) with random weights (``random_init_``'s recipe, which gives non-trivial logits), the
transformer in ``--dtype`` (bf16 default), MAGVIT in float32 (as ``load_showo_policy``), at
256 px (``L = 256``, ``S = 18``, as ``configs/showo_256_clip.yaml``) and 512 px (``L = 1024``,
``S = 50``); ``G = 6``, guidance 0, Show-o's sampler (``tau_0 = 1``, compounding anneal),
transition ``p1``: the sampler and the update are ``configs/showo_256_clip.yaml``'s. Sections (each prints a markdown table):

1. **rollout**: images/s of ``phases.generate`` for ``N`` in ``--batch-sizes``, with the cached
   likelihood Eq. 14 (the baseline) and the Gumbel marginal; the MAGVIT decode's share.
2. **fidelity**: the first update's ``|log pi - log pi_old|`` (the rollout's ``old_logp`` vs
   ``pair_log_probs`` in learner-sized micro-batches, same weights, same dtype) for p1 marginal,
   p1 eq14 and p2.
3. **learner**: (sample, step) pairs/s of ``learner_core.apply_update`` (``TorchOptimizing``,
   AdamW in the module's dtype: pure bf16, no fp32 master weights) on one group's ``TrainBatch``
   with ``--learner-steps`` of the ``S`` steps (evenly spread), per micro-batch size; peak
   ``torch.cuda.max_memory_allocated``.
4. **mfu**: model FLOPs = 2 x matmul parameters x tokens (x3 with backward). Parameters: the 24
   layers (every row) and the lm_head's 8192 codebook columns (the ``L`` image-token rows); the
   input embedding is a lookup. Tokens: the ``L + 2`` image rows per sample per step, plus the
   ``P = 129`` text rows once per distinct prompt (once per rollout; once per micro-batch in the
   learner, which recomputes the prefix). Attention products are not counted (their share is
   printed). Peak: the device's dense bf16 datasheet rate, or ``--peak-tflops``.
5. **weight_sync**: the trained tensors (copied to the CPU as ``trained_state`` does) through
   the object store of a local one-node Ray cluster to a second actor: ``ray.put`` and the
   actor's fetch, the two hops ``ObjectStoreSync`` makes.

Timing: ``torch.cuda.synchronize`` around each call and a host clock (a call is a whole phase,
host work included); one warm-up call per configuration (in the rollout, per resolution and
likelihood), then repeats until ``--min-time-s`` or ``--repeats``; the median. Each section has
a time budget (x ``--budget-scale``): a configuration predicted to overrun it is skipped and
recorded as skipped, so the default run takes about 8 minutes on an H100. Results go to
``--out`` (default ``$OUT/bench_gpu.json``, else ``bench/results_gpu.json``), rewritten after
every section.

Run: ``python -m bench.bench_gpu`` (GPU) or ``python -m bench.bench_gpu --smoke`` (tiny random
Show-o on the CPU, float32, one thread, seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.config import load_config
from maskgrpo_ray.models.magvit import MagvitConfig, MAGVITv2
from maskgrpo_ray.models.showo import ShowoPolicy, build_tiny_random_policy, random_init_
from maskgrpo_ray.models.showo_phi import PhiConfig, ShowoTransformer
from maskgrpo_ray.models.showo_prompting import HashingWordTokenizer, ShowoVocab
from maskgrpo_ray.pipeline.learner_core import (
    TorchOptimizing,
    UpdatePlan,
    apply_update,
    build_optimizer,
)
from maskgrpo_ray.pipeline.learner_loss import abs_log_ratio_stats, pair_log_probs, train_pairs
from maskgrpo_ray.pipeline.messages import RolloutBatch, TrainBatch
from maskgrpo_ray.pipeline.phases import generate
from maskgrpo_ray.pipeline.settings import UpdateSettings, settings_from_config
from maskgrpo_ray.planner.cost_model import FlopModel, peak_bf16

# the sampler and the update of the paper's main setting (G, tau_0, guidance, clip, AdamW, ...)
CONFIG = settings_from_config(
    load_config(Path(__file__).parents[1] / "configs/showo_256_clip.yaml")
)
GROUP_SIZE = CONFIG.rollout.group_size  # G = 6
LIKELIHOODS = ("eq14", "marginal")  # the baseline first
FIDELITY_KINDS = (("p1", "marginal"), ("p1", "eq14"), ("p2", "eq14"))
BUDGET_S = {"rollout": 180.0, "fidelity": 60.0, "learner": 130.0, "weight_sync": 60.0}
UNITS = {
    "seconds": "s",
    "images_per_s": "img/s",
    "pairs_per_s": "pairs/s",
    "tflops_per_s": "TFLOP/s",
    "best_tflops_per_s": "TFLOP/s",
    "mfu": "of peak",
    "peak_mem_gib": "GiB",
    "time_vs_eq14": "x",
    "put_s": "s",
    "fetch_s": "s",
    "gb_per_s": "GB/s",
}


@dataclass(frozen=True)
class Shape:
    name: str
    num_image_tokens: int  # L
    num_steps: int  # S


FULL_SHAPES = {"256": Shape("256px", 256, 18), "512": Shape("512px", 1024, 50)}
SMOKE_SHAPES = {"256": Shape("tiny-16tok", 16, 4), "512": Shape("tiny-64tok", 64, 6)}
DEFAULTS = {  # (full run, smoke run)
    "batch_sizes": ("6,24,48", "6,12"),
    "micro_batches": ("4,8,16", "4,8"),
    "learner_steps": (8, 2),
    "repeats": (3, 1),
    "min_time_s": (3.0, 0.0),
    "dtype": ("bfloat16", "float32"),
    "fidelity_micro_batch": (8, 4),
}


def flop_model_of(policy: ShowoPolicy) -> FlopModel:
    """The project's FLOP model (``maskgrpo_ray.planner.cost_model.FlopModel``) of a built policy."""
    phi, cfg = policy.transformer.showo.model, policy.transformer.config
    body = sum(p.numel() for m in (phi.layers, phi.final_layernorm) for p in m.parameters())
    head = policy.codebook_size * (cfg.hidden_size + 1)
    return FlopModel(body, head, policy.max_text_len + 1, cfg.hidden_size, len(phi.layers))


@dataclass
class Bench:
    """What every section reads: the run's choices, the policies, rollouts to reuse, results."""

    args: argparse.Namespace
    device: torch.device
    policies: dict[str, ShowoPolicy]  # shape name -> policy (one shared transformer)
    peak_flops: float | None
    started: float
    group_rollouts: dict[tuple[str, str], RolloutBatch] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)

    def say(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.started:7.1f} s] {msg}", flush=True)

    def shapes(self) -> list[Shape]:
        return [
            (SMOKE_SHAPES if self.args.smoke else FULL_SHAPES)[r] for r in self.args.resolutions
        ]

    @property
    def flops(self) -> FlopModel:
        return flop_model_of(next(iter(self.policies.values())))

    def mfu(self, flops: float, seconds: float) -> float | None:
        return flops / seconds / self.peak_flops if self.peak_flops else None


class SectionClock:
    """A section's time budget: configurations that would overrun it are skipped."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.perf_counter()

    def fits(self, predicted_s: float) -> bool:
        return time.perf_counter() - self.start + predicted_s <= self.seconds


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def timed_call(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Seconds of one call, the device synchronised before and after; and its value."""
    if _cuda(device):
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    value = fn()
    if _cuda(device):
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, value


def measure(fn: Callable[[], Any], b: Bench, clock: SectionClock, *, warmup: bool) -> dict:
    """Median seconds over repeats (after a warm-up call when asked), within the section's
    budget; with no room for a repeat after the warm-up, the warm-up's time (``repeats: 0``)."""
    first = timed_call(fn, b.device)[0] if warmup else None
    times: list[float] = []
    while len(times) < b.args.repeats and not (times and sum(times) >= b.args.min_time_s):
        last = times[-1] if times else first
        if last is not None and not clock.fits(last):
            break
        times.append(timed_call(fn, b.device)[0])
    seconds = statistics.median(times) if times else first
    return {"seconds": seconds, "repeats": len(times), "times_s": times, "warmup_s": first}


def _fresh(device: torch.device) -> None:
    """Give cached blocks back to the device and restart the peak-memory count."""
    if _cuda(device):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if _cuda(device) else None


def build_policies(args: argparse.Namespace, device: torch.device) -> dict[str, ShowoPolicy]:
    """One transformer and one MAGVIT, bound at each shape's ``L`` (the weights are shared)."""
    shapes = [(SMOKE_SHAPES if args.smoke else FULL_SHAPES)[r] for r in args.resolutions]
    if args.smoke:
        base = build_tiny_random_policy(args.seed, num_image_tokens=shapes[0].num_image_tokens)
        transformer, vq, vocab, text_len = base.transformer, base.vq, base.vocab, base.max_text_len
    else:
        vocab, text_len = ShowoVocab(), 128  # Show-o's id layout (58498 ids) and prompt length
        with torch.device("meta"):  # allocated once, on the device, then filled
            transformer = ShowoTransformer(PhiConfig(vocab_size=vocab.vocab_size))
        transformer = random_init_(transformer.to_empty(device=device), args.seed)
        vq = random_init_(MAGVITv2(MagvitConfig(), with_encoder=False), args.seed + 1, 0.1)
    transformer.to(device=device, dtype=getattr(torch, args.dtype))
    vq.to(device=device, dtype=torch.float32)
    return {
        s.name: ShowoPolicy(
            transformer,
            vq,
            HashingWordTokenizer(vocab),
            vocab,
            num_image_tokens=s.num_image_tokens,
            max_text_len=text_len,
        ).eval()
        for s in shapes
    }


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
    _fresh(b.device)
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
    return row | {"peak_mem_gib": _peak_gib(b.device)}


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
    _ratio_to_eq14(rows, "N")
    print_table(
        "rollout: phases.generate, p1, G=6, guidance 0 (time includes the MAGVIT decode)",
        ["shape", "likelihood", "N", "S", "seconds", "images_per_s", "time_vs_eq14"]
        + ["decode_share", "tflops_per_s", "mfu", "peak_mem_gib", "repeats"],
        rows,
    )
    return {"rows": rows}


def _ratio_to_eq14(rows: list[dict[str, Any]], key: str) -> None:
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
    _fresh(b.device)
    try:
        timing = measure(lambda: apply_update(opt, batch, plan, settings), b, clock, warmup=True)
    except torch.OutOfMemoryError:
        opt.zero_grad()
        return {"pairs": pairs, "skipped": "out of memory"}
    sec, prefixes = timing["seconds"], text_prefixes(batch, plan, mb)
    flops = 3 * b.flops.forward(shape.num_image_tokens, pairs, prefixes)
    row = timing | {"pairs": pairs, "pairs_per_s": pairs / sec, "text_prefixes": prefixes}
    row |= {"tflops_per_s": flops / sec / 1e12, "mfu": b.mfu(flops, sec)}
    return row | {"peak_mem_gib": _peak_gib(b.device)}


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
    _ratio_to_eq14(rows, "micro_batch")
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


class SyncTarget:
    """Stands in for a rollout actor's ``load_weights``: receives the state, reports bytes."""

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> tuple[int, int]:
        return version, sum(v.numel() * v.element_size() for v in state.values())


def bench_weight_sync(b: Bench) -> dict[str, Any]:
    """Trained tensors to the CPU (as ``trained_state``), ``ray.put``, a second actor's fetch."""
    if b.args.no_ray:
        return {"skipped": "--no-ray"}
    import ray

    from maskgrpo_ray.cluster.attach import connect, disconnect

    if __name__ != "__main__":  # imported (tests): ship SyncTarget by value
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    params = [(n, p) for n, p in b.policies[b.shapes()[0].name].named_parameters()]
    d2h_s, state = timed_call(
        lambda: {n: p.detach().cpu().clone() for n, p in params if p.requires_grad}, b.device
    )
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    b.say(f"weight sync: {nbytes / 1e9:.4g} GB in {len(state)} tensors; starting Ray")
    clock = SectionClock(BUDGET_S["weight_sync"] * b.args.budget_scale)
    handle = connect(None, num_cpus=4, include_dashboard=False)
    rows: list[dict[str, Any]] = []
    try:
        target = ray.remote(num_cpus=1)(SyncTarget).remote()
        for version in range(1, (2 if b.args.smoke else 4) + 1):
            if rows and not clock.fits(rows[-1]["put_s"] + rows[-1]["fetch_s"]):
                break
            t0 = time.perf_counter()
            ref = ray.put(state)
            t1 = time.perf_counter()
            got = ray.get(target.load_weights.remote(ref, version), timeout=600)
            t2 = time.perf_counter()
            assert got == (version, nbytes), (got, version, nbytes)
            del ref
            rows.append({"version": version, "put_s": t1 - t0, "fetch_s": t2 - t1})
            rows[-1]["gb_per_s"] = nbytes / 1e9 / (t2 - t0)
    finally:
        disconnect(handle)
    steady = rows[1:] or rows  # the first push includes the actor's start
    out = {"bytes": nbytes, "tensors": len(state), "d2h_s": d2h_s, "pushes": rows}
    out |= {k: statistics.median(r[k] for r in steady) for k in ("put_s", "fetch_s", "gb_per_s")}
    print_table(
        f"weight sync: {nbytes / 1e9:.4g} GB of trained tensors ({b.args.dtype}) through the Ray "
        f"object store, one node (GPU->CPU copy before it: {d2h_s:.3f} s)",
        ["version", "put_s", "fetch_s", "gb_per_s"],
        rows,
    )
    return out


def summarize(b: Bench) -> dict[str, Any]:
    """One line per shape: each section's headline figure."""
    rows = []
    for shape in b.shapes():
        row: dict[str, Any] = {"shape": shape.name}
        for phase, key, unit in (
            ("rollout", "images_per_s", "img/s"),
            ("learner", "pairs_per_s", "pairs/s"),
        ):
            for lik in LIKELIHOODS:
                done = [
                    r[key]
                    for r in b.results[phase]["rows"]
                    if r["shape"] == shape.name and r["likelihood"] == lik and "seconds" in r
                ]
                row[f"{phase} {lik} ({unit}, best)"] = max(done, default=None)
        fid = {
            r["kind"]: r.get("max")
            for r in b.results["fidelity"]["rows"]
            if r["shape"] == shape.name
        }
        row["max abs log-ratio p1 marginal (nats)"] = fid.get("p1 marginal")
        row["sync (GB/s)"] = b.results["weight_sync"].get("gb_per_s")
        rows.append(row)
    print_table("summary", list(rows[0]), rows)
    return {"rows": rows}


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}" if v == 0 or 1e-3 <= abs(v) < 1e5 else f"{v:.2e}"
    return str(v)


def print_table(title: str, cols: list[str], rows: list[dict[str, Any]]) -> None:
    """A markdown table; a skipped configuration keeps its name columns and says why."""
    head = [f"{c} ({UNITS[c]})" if c in UNITS else c for c in cols]
    lines = [f"\n### {title}\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(cols)]
    names = ("shape", "likelihood", "kind", "N", "S", "micro_batch", "pairs")
    for r in rows:
        cells = [_fmt(r.get(c)) if c in names or "skipped" not in r else "" for c in cols]
        if "skipped" in r:
            cells[-1] = f"skipped: {r['skipped']}"
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines) + "\n", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Show-o at full size on one GPU (see the docstring)")
    ap.add_argument("--smoke", action="store_true", help="tiny random Show-o, CPU, seconds")
    ap.add_argument("--device", default="auto", help="auto (cuda; smoke: cpu), cpu, cuda, cuda:1")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="transformer dtype")
    ap.add_argument("--resolutions", default="256,512", help="256 and/or 512")
    ap.add_argument("--batch-sizes", help="rollout N, multiples of G=6 (default 6,24,48)")
    ap.add_argument("--micro-batches", help="learner pairs per forward (default 4,8,16)")
    ap.add_argument("--learner-steps", type=int, help="unmasking steps trained per sample (8)")
    ap.add_argument("--repeats", type=int, help="timed calls per configuration at most (3)")
    ap.add_argument("--min-time-s", type=float, help="no more repeats once this is timed (3)")
    ap.add_argument("--fidelity-micro-batch", type=int, help="pairs per recomputation (8)")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="x the section budgets")
    ap.add_argument("--peak-tflops", type=float, help="peak dense TFLOP/s for the MFU")
    ap.add_argument("--no-ray", action="store_true", help="skip the weight-sync section")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="results JSON (default $OUT/bench_gpu.json, else bench/)")
    args = ap.parse_args(argv)
    for name, (full, smoke) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    args.resolutions = [r.strip() for r in args.resolutions.split(",")]
    args.batch_sizes = [int(x) for x in str(args.batch_sizes).split(",")]
    args.micro_batches = [int(x) for x in str(args.micro_batches).split(",")]
    if any(n % GROUP_SIZE for n in args.batch_sizes):
        ap.error(f"--batch-sizes must be multiples of G={GROUP_SIZE} (whole groups)")
    if args.out is None:
        out = os.environ.get("OUT")
        args.out = str(Path(out) / "bench_gpu.json") if out else "bench/results_gpu.json"
    return args


def device_info(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Device, versions, precision flags and the peak rate the MFU divides by."""
    info: dict[str, Any] = {"torch": torch.__version__, "device": str(device), "args": vars(args)}
    info |= {"threads": torch.get_num_threads(), "peak_flops": None}
    if args.peak_tflops:
        info["peak_flops"] = args.peak_tflops * 1e12
    if _cuda(device):
        name = torch.cuda.get_device_name(device)
        info |= {"device_name": name, "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
        info |= {"tf32_cudnn": torch.backends.cudnn.allow_tf32}
        if info["peak_flops"] is None:
            info["peak_flops"] = peak_bf16(name)
    return info


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """The whole benchmark; None (after a message) when a GPU run finds no CUDA."""
    want = args.device if args.device != "auto" else ("cpu" if args.smoke else "cuda")
    if want.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device, nothing measured (--smoke checks the script on the CPU)")
        return None
    if want == "cuda":
        want = f"cuda:{torch.cuda.current_device()}"
    device = torch.device(want)
    if _cuda(device):
        torch.cuda.set_device(device)
    elif args.smoke:
        torch.set_num_threads(1)  # shared CI/dev cores: one thread is faster and steadier
    t0 = time.perf_counter()
    info = device_info(args, device)
    b = Bench(args, device, build_policies(args, device), info["peak_flops"], t0)
    b.results["meta"] = info | {"build_s": time.perf_counter() - t0}
    b.say(f"built on {info.get('device_name', device)} ({args.dtype})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, section in (
        ("rollout", bench_rollout),
        ("fidelity", bench_fidelity),
        ("learner", bench_learner),
        ("mfu", bench_mfu),
        ("weight_sync", bench_weight_sync),
        ("summary", summarize),
    ):
        b.results[name] = section(b)
        b.results["meta"]["elapsed_s"] = time.perf_counter() - t0
        out.write_text(json.dumps(b.results, indent=1, default=str))
        _fresh(device)
    b.say(f"results written to {out}")
    return b.results


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
