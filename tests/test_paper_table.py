"""bench/paper_table.py's verdicts: an ordering of the paper holds, is reversed or is not resolved
by the paired interval of the seeds' differences, and one seed makes no interval."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


@pytest.fixture(scope="module")
def pt():
    from bench import paper_table

    return paper_table


def _eval(score: float, div: float) -> dict[str, float]:
    out = {"eval_accuracy/tag_mean": score, "eval_diversity/pairwise": div}
    out.update({f"eval_accuracy/{t}": score for t in TAGS})
    out.update({f"eval_diversity/pairwise/{t}": div for t in TAGS})
    if div > 0.15:  # a record without the layouts figure: the table leaves it out
        out["eval_diversity/layouts"] = 0.8
    return out


def _run(variant: str, seed: int, final: float) -> dict:
    base = 0.3
    return {
        "variant": variant,
        "seed": seed,
        "base": _eval(base, 0.2),
        "final": _eval(final, 0.1),
        "curve": [
            {"step": 0, "eval_accuracy/tag_mean": base},
            {"step": 60, "eval_accuracy/tag_mean": final},
        ],
        "train_reward": [1.0] * 20,
        "train_accuracy": [0.5] * 20,
        "step_seconds": 5.0,
        "update_seconds": 2.0,
    }


def _orders(pt, finals: dict[str, list[float]]) -> dict[str, str]:
    runs = [_run(n, s, f) for n, fs in finals.items() for s, f in enumerate(fs)]
    seeds = list(range(len(next(iter(finals.values())))))
    t = pt.table(runs, list(finals), seeds)
    md = pt.markdown(t, seeds, 60)
    assert f"| base | {len(seeds)} | 0.53 |" in md and "Diversity of the held-out samples" in md
    return {o["lower"]: pt.verdict(o["d_final"], o["seeds"]) for o in t["orderings"]}


def test_the_papers_orderings_are_read_off_the_paired_interval(pt):
    full, kl, nf = pt.FULL, "w/ KL (beta 0.04)", "w/o sample filter"
    got = _orders(
        pt,
        {
            full: [0.50, 0.55, 0.45, 0.52],
            kl: [0.40, 0.46, 0.34, 0.43],  # below the full method on every seed: holds
            nf: [0.60, 0.66, 0.54, 0.62],  # above it on every seed: reversed
        },
    )
    assert got[kl] == "holds"
    assert got[nf] == "reversed"
    noisy = _orders(pt, {full: [0.5, 0.5, 0.5], kl: [0.6, 0.4, 0.45]})
    assert noisy[kl].startswith("not resolved")
    one = _orders(pt, {full: [0.5], kl: [0.1]})
    assert one[kl] == "one seed: no interval"


def test_a_batch_under_way_makes_a_partial_table_that_says_how_it_resumes(pt):
    """Seeds 0-4 and 10-12 asked; the KL row has two seeds, the filter row none yet: the table
    counts each row's and ordering's seeds, leaves out the ordering with no pair, and says how
    many runs are missing and the command that resumes the batch."""
    full, kl, nf = pt.FULL, "w/ KL (beta 0.04)", "w/o sample filter"
    seeds = [0, 1, 2, 3, 4, 10, 11, 12]
    runs = [_run(full, s, 0.5 + 0.01 * s) for s in seeds] + [_run(kl, s, 0.4) for s in (0, 1)]
    t = pt.table(runs, [full, kl, nf], seeds)
    rows = {r["variant"]: r for r in t["rows"]}
    assert rows["base"]["seeds"] == 8 and rows[kl]["seeds"] == 2 and nf not in rows
    orders = {o["lower"]: o for o in t["orderings"]}
    assert orders[kl]["seeds"] == 2 and nf not in orders
    md = pt.markdown(t, seeds, 60, missing=14)
    assert "Seeds 0-4,10-12 (8)" in md
    assert "Under way: 14 of 24 runs not yet recorded" in md
    assert "python -m bench.paper_table --seeds 0-4,10-12 --jobs 2 --commit" in md
    assert "Under way" not in pt.markdown(t, seeds, 60)


def test_seed_lists_read_ranges_and_lists_and_print_back_the_same():
    from bench import toy_lab as lab

    assert lab.seeds_of("0-4,10-12") == [0, 1, 2, 3, 4, 10, 11, 12]
    assert lab.seeds_of("0-7") == list(range(8)) and lab.seeds_of("3,1") == [3, 1]
    for spec in ("0-4,10-12", "0-7", "2", "0,2,4", "0-1,5,7-9"):
        assert lab.seeds_spec(lab.seeds_of(spec)) == spec
