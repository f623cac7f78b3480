"""``maskgrpo plan``: the rollout/learner split of N GPUs from a cost profile.

    maskgrpo plan --profile showo_512_h100 --gpus 16
    maskgrpo plan --model showo --resolution 512 --gpu A100 --gpus 16 --estimator forward

Prints the recommended split, its predicted images/s and GPU busy fractions, every split's
prediction, the work-conserving limit ``n / (r + l)``, and what a learner checkpoint costs at
the run's cadence (bytes, seconds, the share of the run, what a kill loses), all from
:mod:`maskgrpo_ray.planner.cost_model` (the model ``bench/bench_cluster_sim.py`` checks against the
simulated cluster). Predictions come from a FLOP model at stated MFUs: a plan, not a measurement.

With ``--config`` the loop is the config's: ``rollout.max_policy_lag`` 0 plans the synchronous
loop, 1 or more the asynchronous one (``--sync`` / ``--async`` override it); and the recipe's
quality evidence (the config's ``evidence`` section) is printed beside its speed, or "no quality
evidence" when a ``--set`` changed the recipe the evidence was measured for.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from typing import Any, NamedTuple

from maskgrpo_ray.planner.checkpoint_cost import CheckpointCost, checkpoint_bytes, checkpoint_cost
from maskgrpo_ray.planner.cost_model import (
    PROFILES,
    CostProfile,
    Workload,
    showo_profile,
)
from maskgrpo_ray.planner.reward_cost import with_rewards
from maskgrpo_ray.planner.split import SplitPlan, pipeline_ideal, plan_split


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="recommend a rollout/learner GPU split from a cost profile")
    p.add_argument("--profile", help=f"a built-in cost profile ({', '.join(sorted(PROFILES))})")
    p.add_argument("--model", choices=["showo"], help="instead of --profile: the model ...")
    p.add_argument("--resolution", type=int, choices=[256, 512], default=512, help="... its px")
    p.add_argument("--gpu", default="H100", help="... and the GPU (H100, H200, A100, L40S)")
    p.add_argument("--gpus", type=int, default=16, help="GPUs to split (rollout + learner)")
    p.add_argument("--estimator", choices=["trajectory", "forward"], default=None)
    p.add_argument("--prompts-per-step", type=int, default=None, help="B (default: profile's)")
    loop = p.add_mutually_exclusive_group()
    loop.add_argument(
        "--sync", action="store_true", help="plan the synchronous loop (lag 0; a config's default)"
    )
    loop.add_argument(
        "--async",
        dest="asynchronous",
        action="store_true",
        help="plan the asynchronous loop (lag >= 1; a profile's default)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--config",
        default=None,
        help="take the workload from a run config (B, G, S, the unmasking steps or mask draws "
        "trained, inner updates, estimator) and, for model.kind showo or sim, the profile",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --config: override a config field (repeatable)",
    )


def _profile(args: argparse.Namespace) -> CostProfile:
    if args.profile is not None:
        if args.profile not in PROFILES:
            raise ValueError(
                f"--profile {args.profile!r} is not a built-in profile; use one of "
                f"{', '.join(sorted(PROFILES))}, or --model showo --resolution PX --gpu NAME"
            )
        p = PROFILES[args.profile]
    elif args.model == "showo":
        steps = 50 if args.resolution == 512 else 18
        try:
            p = showo_profile(
                f"showo_{args.resolution}_{args.gpu.lower()}",
                args.resolution,
                unmasking_steps=steps,
                device=args.gpu,
            )
        except ValueError as err:
            raise ValueError(
                f"--gpu {args.gpu!r}: no datasheet rate for it (known: H100, H200, A100, "
                "L40S); pick one of those or write a profile (docs/simulation.md)"
            ) from err
    else:
        raise ValueError("give --profile NAME, or --model showo --resolution PX --gpu NAME")
    if args.estimator is not None and args.estimator != p.estimator:
        p = replace(
            p, estimator=args.estimator, updates_per_batch=4 if args.estimator == "forward" else 1
        )
    if args.prompts_per_step is not None:
        p = replace(p, prompts_per_step=args.prompts_per_step)
    return p


class Evidence(NamedTuple):
    """What the planned recipe is known to keep: the config's ``evidence``, or none."""

    source: str  # "none" | "paper" | "proxy_toy" | "proxy_shapes" | "other_model"
    line: str  # what the planner prints
    changed: list[str]  # --set keys that changed the recipe (the file's evidence then void)

    def to_dict(self) -> dict[str, Any]:
        return self._asdict()


NO_RECIPE = Evidence(
    "none", "no quality evidence (a cost profile, not a recipe: --config plans one)", []
)


class Planned(NamedTuple):
    """What :func:`make_plan` answers (``report(*planned)`` is ``--json``'s object)."""

    profile: CostProfile
    work: Workload
    plan: SplitPlan
    evidence: Evidence = NO_RECIPE
    probe: tuple[float, float] = (0.0, 0.0)  # the step-signal probe's pairs, images per image


def _evidence(cfg: Any, overrides: list[str]) -> Evidence:
    """The config's evidence line, void when an override changed its recipe."""
    from maskgrpo_ray.config import parse_overrides
    from maskgrpo_ray.config.evidence import LABELS, recipe_keys

    changed = recipe_keys([key for key, _ in parse_overrides(overrides)])
    if changed and cfg.evidence.source != "none":
        line = (
            f"{LABELS['none']} for this recipe: --set {', '.join(changed)} changed the one the "
            f"file's evidence is for ({cfg.evidence.line()})"
        )
        return Evidence("none", line, changed)
    return Evidence(cfg.evidence.source, cfg.evidence.line(), changed)


def _from_config(args: argparse.Namespace) -> tuple[CostProfile, Workload, Any]:
    """The profile, the workload and the config of ``--config``: the config's step, with the
    profile named by ``--profile``, else the sim model's own, else Show-o's at the config's
    resolution on ``--gpu``."""
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.planner.cost_model import workload_of

    cfg = load_config(args.config, args.overrides)
    work = workload_of(cfg)
    if args.profile is None and cfg.model.kind == "sim":
        from maskgrpo_ray.worlds.toy.sim import sim_settings

        profile = sim_settings(cfg.model).cost_profile()
    elif args.profile is None and cfg.model.kind == "showo":
        args.model, args.resolution = "showo", cfg.model.showo.resolution_px
        kinds = [c.kind for c in cfg.reward.components]
        profile = with_rewards(_profile(args), kinds)  # the config's reward side, per image
    elif args.profile is not None:
        profile = _profile(args)
    else:
        raise ValueError(
            f"--config {args.config}: model.kind {cfg.model.kind!r} has no cost profile; give "
            f"--profile NAME ({', '.join(sorted(PROFILES))})"
        )
    return profile, work, cfg


def _asynchronous(args: argparse.Namespace, cfg: Any) -> bool:
    """The loop to plan: ``--sync`` / ``--async``, else the config's ``rollout.max_policy_lag``
    (0: synchronous), else (a profile) asynchronous."""
    if args.sync or getattr(args, "asynchronous", False):
        return not args.sync
    return cfg is None or cfg.rollout.max_policy_lag > 0


def make_plan(args: argparse.Namespace) -> Planned:
    """The profile ``args`` name (or ``--config``'s), its workload, the recommended split for
    the loop to plan and the recipe's evidence; ValueError (one line, the fix) for a profile,
    GPU or option that does not exist."""
    from maskgrpo_ray.planner.cost_model import probe_overhead

    cfg, evidence, probe = None, NO_RECIPE, (0.0, 0.0)
    if getattr(args, "config", None) is not None:
        profile, work, cfg = _from_config(args)
        evidence, probe = _evidence(cfg, args.overrides), probe_overhead(cfg)
    else:
        profile = _profile(args)
        work = Workload.of_profile(profile)
    split = plan_split(profile, work, args.gpus, asynchronous=_asynchronous(args, cfg))
    split = replace(split, checkpoint=_checkpoint(cfg, profile, work, split))
    return Planned(profile, work, split, evidence, probe)


def _checkpoint(cfg: Any, profile: CostProfile, work: Workload, plan: SplitPlan) -> CheckpointCost:
    """A learner checkpoint of the profile's model at the recommended split's step time and
    the run's cadence (the ``--config``'s ``run.checkpoint_every_*``, ``learner.bf16`` and
    ``model.lora``; else the defaults, bf16 and full fine-tuning, as the Show-o configs)."""
    from maskgrpo_ray.config import RunConfig

    params = profile.weight_bytes // 2  # the profile's weight sync sends every tensor in bf16
    run, bf16, trained = RunConfig(), True, params  # a profile alone: the defaults (no torch)
    if cfg is not None:
        run, bf16 = cfg.run, cfg.learner.bf16
        trained = 0 if cfg.model.lora is not None else params  # LoRA: the adapter's, negligible
    nbytes = checkpoint_bytes(params, trained, bf16=bf16)
    step_s = work.images / plan.images_per_s
    return checkpoint_cost(
        nbytes,
        step_s,
        run.checkpoint_every_steps,
        run.checkpoint_every_minutes,
        asynchronous=run.checkpoint_async,
        ranks=plan.learner_gpus,
    )


def report(
    profile: CostProfile,
    work: Workload,
    plan: SplitPlan,
    evidence: Evidence = NO_RECIPE,
    probe: tuple[float, float] = (0.0, 0.0),
) -> dict[str, Any]:
    """``maskgrpo plan --json``'s object (the Python API's ``plan`` returns it); the busy shares
    are those of the planned loop (``asynchronous``)."""
    rollout_busy, learner_busy = pipeline_ideal(plan.costs).busy(plan.asynchronous)
    return {
        "profile": profile.to_dict(),
        "workload": asdict(work),
        "asynchronous": plan.asynchronous,
        "recommended": {"rollout_gpus": plan.rollout_gpus, "learner_gpus": plan.learner_gpus},
        "images_per_s": plan.images_per_s,
        "images_per_gpu_s": plan.images_per_s / plan.gpus,
        "work_conserving_limit": plan.limit,
        "rollout_busy": rollout_busy,
        "learner_busy": learner_busy,
        "evidence": evidence.to_dict(),
        "step_signal_probe": {
            "learner_pairs_per_image": probe[0],
            "rollout_images_per_image": probe[1],
        },
        "splits": [{"rollout": r, "learner": n, "images_per_s": v} for r, n, v in plan.table],
        "checkpoint": None if plan.checkpoint is None else asdict(plan.checkpoint),
    }


def run(args: argparse.Namespace) -> int:
    try:
        planned = make_plan(args)
    except ValueError as err:
        print(f"maskgrpo plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report(*planned), indent=2))
        return 0
    profile, work, plan, evidence, probe = planned
    c = plan.costs
    rollout_busy, learner_busy = pipeline_ideal(c).busy(plan.asynchronous)
    loop = "asynchronous" if plan.asynchronous else "synchronous"
    mode = f"{loop} (max_policy_lag {'>= 1' if plan.asynchronous else '0'})"
    print(f"profile {profile.name} ({profile.device}; {profile.source})")
    print(
        f"workload: B={work.prompts_per_step} G={work.samples_per_prompt} "
        f"S={work.unmasking_steps}, {work.units_per_sample * work.updates_per_batch:g} trained "
        f"pairs per sample in {work.forward_passes_per_sample * work.updates_per_batch:g} "
        f"forward rows, {work.learner_pairs(profile.learner_scoring_share):.4g} pairs' learner "
        f"work ({work.estimator or profile.estimator}); {mode}"
    )
    print(
        f"per image: rollout r={c.r:.3f} GPU-s, learner l={c.l:.3f} GPU-s, reward "
        f"{profile.reward_seconds_per_image * 1e3:.2f} GPU-ms (the reward actors', beside the "
        f"rollouts: {c.reward_s:.2f} GPU-s a step); weight sync W={c.sync_s:.3f} s per step"
    )
    print("\n| rollout | learner | predicted img/s | of limit |\n|---|---|---|---|")
    for r, n, v in plan.table:
        mark = "  <- recommended" if r == plan.rollout_gpus else ""
        print(f"| {r} | {n} | {v:.2f} | {v / plan.limit:.3f} |{mark}")
    print(
        f"\nrecommended: {plan.rollout_gpus} rollout + {plan.learner_gpus} learner GPUs "
        f"(rollout.num_actors={plan.rollout_gpus}, learner.num_workers={plan.learner_gpus}): "
        f"{plan.images_per_s:.2f} img/s ({plan.images_per_s / args.gpus:.3f} img/GPU/s), "
        f"R={c.rollout_s:.2f} s, L={c.learner_s:.2f} s per step; busy: rollout GPUs "
        f"{rollout_busy:.2f}, learner GPUs {learner_busy:.2f} ({loop}); work-conserving "
        f"limit {plan.limit:.2f} img/s ({plan.images_per_s / plan.limit:.3f} of it). A model, "
        f"not a measurement. Evidence: {evidence.line}."
    )
    if plan.checkpoint is not None:
        print(_checkpoint_line(plan.checkpoint))
    if probe[0]:
        print(
            f"the step-signal probe (train.step_signal_every_steps) adds {probe[0]:.2f} learner "
            f"pairs and {probe[1]:.3f} rollout images per trained image, not in the split above"
        )
    return 0


def _checkpoint_line(ck: CheckpointCost) -> str:
    """What a checkpoint costs and what the cadence loses (checkpoint_cost.CheckpointRates)."""
    if ck.interval_s == float("inf"):
        cadence = "no cadence (start, end and SIGTERM only): a SIGKILL loses all since the start"
    else:
        cadence = (
            f"one every {ck.interval_s / 60:.1f} min (run.checkpoint_every_steps or _minutes, "
            f"the sooner) costs {ck.overhead:.1%} of the run; a SIGKILL loses at most "
            f"{ck.loses_s / 60:.1f} min"
        )
    path = ""
    if ck.critical_s < ck.seconds:
        path = f", {ck.critical_s:.1f} s of it on the step loop's path (run.checkpoint_async)"
    return (
        f"checkpoint: {ck.bytes / 1e9:.2f} GB of learner state, about {ck.seconds:.0f} s to "
        f"write{path} (stated disk and network rates, checkpoint_cost.CheckpointRates); {cadence}"
    )
