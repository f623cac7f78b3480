"""Reward against diversity on the GenEval-shaped world, where there is room for it (issue 40).

    .venv/bin/python -m bench.shapes_diversity [--seeds 0-4] [--steps 60] [--jobs 2]
        [--variants "none;..."] [--fresh] [--out bench/results_shapes_diversity.json]
        [--markdown docs/shapes_diversity_table.md] [--plot docs/img/shapes_frontier.png]

Every variant is ``configs/shapes.yaml`` on the single-process backend plus its overrides,
trained ``--steps`` steps per seed (``bench/toy_lab.py``: cached per resolved config and seed).
The figures, on the 40 held-out prompts with ``eval.samples_per_prompt`` images each:

* the gain: GenEval's overall after training minus the base model's (``eval_accuracy/tag_mean``);
* the diversity of a prompt's images, in an embedding that is not the reward's: the mean pairwise
  ``1 - cos`` in the judge's layout embedding (``eval_diversity/pairwise``: the config measures
  diversity in ``shapes_judge``'s space, the dominant colour of every token), the
  nearest-neighbour distance there (``eval_diversity/nn``) and the share of distinct detected
  layouts (``eval_diversity/layouts``).

**The goal** (issue 40, as the anchors claim it): a rule under which, on every one of the seeds,
the gain is at least 80% of the default's (``none``) on that seed and the pairwise diversity at
least 90% of the base model's. The table says, per variant, on how many seeds each half holds;
the frontier plot puts every variant at (diversity kept, gain kept), seeds as error bars.
"""

from __future__ import annotations

import statistics

from bench import toy_lab as lab

CONFIG = "configs/shapes.yaml"
COMMON = ["eval.every_steps=20", "logging.sample_grid_every_steps=0"]
GARDO = ["train.diversity.kind=gardo"]
DIV = "eval_diversity/pairwise"
REF = "none"

# name -> overrides on configs/shapes.yaml (B x G = 48 images a step unless the name says)
VARIANTS: dict[str, list[str]] = {
    REF: [],
    "KL 0.04 to the base": ["train.kl_coef=0.04"],
    "GARDO (centred, as published)": [*GARDO, "train.advantage=centred"],
    "GARDO, re-centred": [*GARDO, "train.diversity.recentre=true"],
    "GARDO in the judge's space": [
        *GARDO,
        "train.diversity.recentre=true",
        "train.diversity.embedding=shapes_judge",
    ],
    "bonus 10 x nn (judge's space)": [
        "train.diversity.kind=bonus",
        "train.diversity.bonus_weight=10.0",
        "train.diversity.embedding=shapes_judge",
    ],
    "anchor first 4 steps, KL 0.1": ["train.anchor_unmasking_steps=4", "train.anchor_kl_coef=0.1"],
    "G = 12 (B = 4)": ["rollout.samples_per_prompt=12", "train.prompts_per_step=4"],
    "G = 16 (B = 3)": ["rollout.samples_per_prompt=16", "train.prompts_per_step=3"],
    "GARDO re-centred, G = 12 (B = 4)": [
        *GARDO,
        "train.diversity.recentre=true",
        "rollout.samples_per_prompt=12",
        "train.prompts_per_step=4",
    ],
}


def figures(r: dict) -> dict[str, float]:
    return {
        "gain": lab.score(r) - lab.score(r, "base"),
        "final": lab.score(r),
        "pairwise": r["final"][DIV],
        "base_pairwise": r["base"][DIV],
        "nn": r["final"].get("eval_diversity/nn", float("nan")),
        "layouts": r["final"].get("eval_diversity/layouts", float("nan")),
        "base_layouts": r["base"].get("eval_diversity/layouts", float("nan")),
    }


def rows_of(runs: list[dict], names: list[str]) -> list[dict]:
    ref = {r["seed"]: figures(r) for r in lab.of(runs, REF)}
    rows = []
    for n in names:
        rs = lab.of(runs, n)
        if not rs:
            continue
        f = {r["seed"]: figures(r) for r in rs}
        kept_gain = [f[s]["gain"] / ref[s]["gain"] for s in f if s in ref and ref[s]["gain"] > 0]
        kept_div = [f[s]["pairwise"] / f[s]["base_pairwise"] for s in f]
        row: dict = {"variant": n, "seeds": sorted(f)}
        for k in ("gain", "final", "pairwise", "nn", "layouts"):
            row[k] = lab.interval([x[k] for x in f.values()])
        row["gain_kept"] = lab.interval(kept_gain) if kept_gain else (float("nan"), 0.0)
        row["diversity_kept"] = lab.interval(kept_div)
        row["seeds_gain_ok"] = sum(k >= 0.8 for k in kept_gain)
        row["seeds_diversity_ok"] = sum(k >= 0.9 for k in kept_div)
        row["seeds_both_ok"] = sum(
            s in ref and ref[s]["gain"] > 0 and f[s]["gain"] >= 0.8 * ref[s]["gain"]
            and f[s]["pairwise"] >= 0.9 * f[s]["base_pairwise"]
            for s in f
        )  # fmt: skip
        if n != REF:
            row["d_gain"] = lab.interval(lab.paired(runs, n, REF, lambda r: figures(r)["gain"]))
            row["d_pairwise"] = lab.interval(
                lab.paired(runs, n, REF, lambda r: figures(r)["pairwise"])
            )
        row["step_seconds"] = statistics.fmean(r["step_seconds"] for r in rs)
        rows.append(row)
    return rows


_ci = lab.fmt_interval


def markdown(rows: list[dict], runs: list[dict], steps: int) -> str:
    n = len(rows[0]["seeds"]) if rows else 0
    base = [figures(r) for r in lab.of(runs, REF)]
    out = [
        f"{n} seeds, {steps} steps; diversity in the judge's layout embedding (not the reward's); "
        "95% t-intervals; paired against `none`.\n",
        "| variant | GenEval overall | gain | gain vs none, paired | pairwise | vs none, paired | "
        "distinct layouts | gain kept (of none's) | diversity kept (of the base's) | seeds: gain "
        ">= 80% / diversity >= 90% / both | s per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dg = _ci(r["d_gain"], True) if "d_gain" in r else "-"
        dp = _ci(r["d_pairwise"], True) if "d_pairwise" in r else "-"
        out.append(
            f"| {r['variant']} | {_ci(r['final'])} | {_ci(r['gain'], True)} | {dg} | "
            f"{_ci(r['pairwise'])} | {dp} | {_ci(r['layouts'])} | {_ci(r['gain_kept'])} | "
            f"{_ci(r['diversity_kept'])} | {r['seeds_gain_ok']} / {r['seeds_diversity_ok']} / "
            f"{r['seeds_both_ok']} of {len(r['seeds'])} | {r['step_seconds']:.1f} |"
        )
    if base:
        bp = lab.interval([b["base_pairwise"] for b in base])
        bl = lab.interval([b["base_layouts"] for b in base])
        out.append(
            f"| *base model* | {_ci(lab.interval([b['final'] - b['gain'] for b in base]))} | | | {_ci(bp)} | | {_ci(bl)} | | | | |"
        )
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for r in rows:
        (x, xe), (y, ye) = r["diversity_kept"], r["gain_kept"]
        ax.errorbar(x, y, xerr=xe, yerr=ye, fmt="o" if r["variant"] != REF else "s", capsize=3)
        ax.annotate(r["variant"], (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.axvline(0.9, ls="--", c="grey")
    ax.axhline(0.8, ls="--", c="grey")
    ax.set_xlabel("diversity kept: pairwise distance / the base model's (judge's embedding)")
    ax.set_ylabel("gain kept: GenEval-proxy gain / the default's, same seed")
    ax.set_title(
        "The shapes world: gain against diversity (the goal: upper right of the lines)", fontsize=9
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = lab.experiment_parser(__doc__, "0-4", 60, "results_shapes_diversity.json")
    ap.add_argument("--plot", default="")
    a = ap.parse_args()
    names = lab.variants_of(a.variants, list(VARIANTS), REF)
    seeds = lab.seeds_of(a.seeds)
    jobs = lab.seed_major_jobs(names, VARIANTS, seeds, a.steps, CONFIG, COMMON)

    def describe(r: dict) -> str:
        f = figures(r)
        return (
            f"gain {f['gain']:+.3f}, pairwise {f['pairwise']:.3f} (base {f['base_pairwise']:.3f})"
        )

    runs = lab.run_jobs(jobs, n_jobs=a.jobs, fresh=a.fresh, on_done=lab.progress(34, describe))
    rows = rows_of(runs, names)
    md = markdown(rows, runs, a.steps)
    lab.write_results(a.out, {"steps": a.steps, "seeds": seeds, "rows": rows}, md, a.markdown)
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
