"""bench_gpu's shared parts: the paper's setting, the shapes, the policies at full size (or
tiny), the section clock, the timing of one call (``timed_call``, ``measure``) and the tables
that every section uses."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.config import load_config
from maskgrpo_ray.models.magvit import MagvitConfig, MAGVITv2
from maskgrpo_ray.models.showo import ShowoPolicy, build_tiny_random_policy, random_init_
from maskgrpo_ray.models.showo_phi import PhiConfig, ShowoTransformer
from maskgrpo_ray.models.showo_prompting import HashingWordTokenizer, ShowoVocab
from maskgrpo_ray.pipeline.messages import RolloutBatch
from maskgrpo_ray.pipeline.settings import settings_from_config
from maskgrpo_ray.planner.cost_model import FlopModel

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


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def timed_call(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Seconds of one call, the device synchronised before and after; and its value."""
    if is_cuda(device):
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    value = fn()
    if is_cuda(device):
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


def fresh_memory(device: torch.device) -> None:
    """Give cached blocks back to the device and restart the peak-memory count."""
    if is_cuda(device):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if is_cuda(device) else None


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
