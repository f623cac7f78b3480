"""Reward against diversity on the toy world: the diversity-aware advantages, swept over seeds.

    .venv/bin/python -m bench.diversity_sweep [--seeds 0-4] [--steps 120] [--jobs 2]
        [--variants "none;GARDO;..."] [--fresh] [--out bench/results_diversity_sweep.json]
        [--markdown docs/diversity_table.md]

RL on image models trades diversity for reward. Every variant is ``configs/toy.yaml`` on the
single-process backend plus its overrides, trained for ``--steps`` steps on each seed; the base
and the tuned model are evaluated on the 24 held-out prompts with 32 samples each (the same
evaluation sampler for every variant: temperature 1, Gumbel tau 0, fixed seeds). Per variant the
table gives, after training, the held-out accuracy and the three diversity figures of
``maskgrpo_ray.algo.diversity`` (distinct images of 32, mean pairwise and nearest-neighbour distance
in the reward's embedding: the toy's palette cells, so ``1 - cos`` is the share of cells that
differ), each as mean and 95% t-interval over the seeds, the paired difference against ``none``
(the same config without a diversity rule) for accuracy and distinct, the lowest seed's
figures, and the learner's and the whole step's seconds. Runs are cached per (variant, seed)
(``bench/toy_lab.py``): a rerun with more seeds runs only the new ones.
"""

from __future__ import annotations

import statistics

from bench import toy_lab as lab

TWO = (
    "reward.components=[{kind: toy_rules, args: {terms: score, name: toy_score}}, "
    "{kind: toy_rules, args: {terms: correct, name: toy_correct}}]"
)
GARDO = ["train.diversity.kind=gardo"]

# name -> overrides on configs/toy.yaml
VARIANTS: dict[str, list[str]] = {
    "none": [],
    "KL 0.05 (per token)": ["train.kl_coef=0.05"],
    "GARDO (centred, as published)": [*GARDO, "train.advantage=centred"],
    "GARDO on GRPO advantages": GARDO,
    "GARDO, re-centred": [*GARDO, "train.diversity.recentre=true"],
    "bonus 3 x nn": ["train.diversity.kind=bonus", "train.diversity.bonus_weight=3.0"],
    "bonus 10 x nn": ["train.diversity.kind=bonus", "train.diversity.bonus_weight=10.0"],
    "two components, summed (GRPO)": [TWO],
    "two components, GDPO": [TWO, "train.advantage=gdpo"],
    "anchor first 6 steps, KL 0.1": [
        "train.unmasking_step_selection=last",
        "train.unmasking_steps_trained=2",
        "train.anchor_unmasking_steps=6",
        "train.anchor_kl_coef=0.1",
    ],
}
KEYS = ("eval_accuracy", "eval_diversity/distinct", "eval_diversity/pairwise", "eval_diversity/nn")


def rows_of(runs: list[dict], names: list[str], ref: str) -> list[dict]:
    rows = []
    for n in names:
        rs = lab.of(runs, n)
        if not rs:
            continue
        row: dict = {"variant": n, "seeds": [r["seed"] for r in rs]}
        for k in KEYS:
            row[k] = lab.interval([r["final"][k] for r in rs])
            row[f"base_{k}"] = statistics.fmean(r["base"][k] for r in rs)
        row["min_accuracy"] = min(r["final"]["eval_accuracy"] for r in rs)
        row["min_distinct"] = min(r["final"]["eval_diversity/distinct"] for r in rs)
        if n != ref:
            for k in KEYS[:2]:
                row[f"d_{k}"] = lab.interval(lab.paired(runs, n, ref, lambda r, k=k: r["final"][k]))
        row["update_seconds"] = statistics.fmean(r["update_seconds"] for r in rs)
        row["step_seconds"] = statistics.fmean(r["step_seconds"] for r in rs)
        rows.append(row)
    return rows


_ci = lab.fmt_interval


def markdown(rows: list[dict], steps: int) -> str:
    n = len(rows[0]["seeds"]) if rows else 0
    head = (
        f"| variant ({n} seeds, {steps} steps) | accuracy | vs none, paired | distinct of 32 "
        "| vs none, paired | pairwise | nn | lowest seed: accuracy, distinct | learner s/step "
        "| step s |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    out = []
    for r in rows:
        da = _ci(r["d_eval_accuracy"], True) if "d_eval_accuracy" in r else "-"
        dd = _ci(r["d_eval_diversity/distinct"], True) if "d_eval_accuracy" in r else "-"
        out.append(
            f"| {r['variant']} | {_ci(r['eval_accuracy'])} | {da} | "
            f"{_ci(r['eval_diversity/distinct'])} | {dd} | "
            f"{_ci(r['eval_diversity/pairwise'], d=4)} | {_ci(r['eval_diversity/nn'], d=4)} | "
            f"{r['min_accuracy']:.2f}, {r['min_distinct']:.2f} | {r['update_seconds']:.3f} | "
            f"{r['step_seconds']:.3f} |"
        )
    base = rows[0]
    out.append(
        f"| *base model* | {base['base_eval_accuracy']:.3f} | | "
        f"{base['base_eval_diversity/distinct']:.3f} | | "
        f"{base['base_eval_diversity/pairwise']:.4f} | {base['base_eval_diversity/nn']:.4f} | | | |"
    )
    return head + "\n".join(out) + "\n"


def main() -> None:
    ap = lab.experiment_parser(__doc__, "0-4", 120, "results_diversity_sweep.json")
    ap.add_argument("--set", dest="common", action="append", default=[], help="KEY=VALUE for all")
    a = ap.parse_args()
    ref = "none"
    names = lab.variants_of(a.variants, list(VARIANTS), ref)
    seeds = lab.seeds_of(a.seeds)
    extra = tuple(a.common)
    jobs = [lab.Job(n, tuple(VARIANTS[n]), s, a.steps, extra=extra) for n in names for s in seeds]

    def describe(r: dict) -> str:
        f = r["final"]
        return f"accuracy {f['eval_accuracy']:.3f}, distinct {f['eval_diversity/distinct']:.3f}"

    runs = lab.run_from_args(jobs, a, lab.progress(34, describe))
    rows = rows_of(runs, names, ref)
    record = {"steps": a.steps, "rows": rows, "runs": runs}
    lab.write_results(a.out, record, markdown(rows, a.steps), a.markdown, indent=None)


if __name__ == "__main__":
    main()
