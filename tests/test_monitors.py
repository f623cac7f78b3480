"""The monitors (docs/monitors.md): the image statistics, the rank agreement and the rules on
hand-made cases; a toy run whose reward pays for one colour trips the hacking alarm within a
bounded number of steps, the toy's honest rule reward does not."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from maskgrpo_ray.cli import main
from maskgrpo_ray.loop.monitoring import probe_set
from maskgrpo_ray.rewards.base import register_reward
from maskgrpo_ray.runlog.monitors import (
    ALARM,
    DARK,
    EDGES,
    ENTROPY,
    SATURATED,
    MonitorRules,
    average_ranks,
    group_spearman,
    image_statistics,
    monitor_figures,
    monitor_summary,
    newly_tripped,
    reward_agreement,
    trend,
)

BLACK, WHITE, RED = (0, 0, 0), (255, 255, 255), (255, 0, 0)


def _img(rows: list[list[tuple[int, int, int]]]) -> torch.Tensor:
    return torch.tensor([rows], dtype=torch.uint8)  # [1, H, W, 3]


def test_image_statistics_of_a_hand_made_image():
    # [[black, white], [red, red]]
    # colours (each channel // 64): black bin 0, white 63, red 48 twice: p = 1/4, 1/4, 1/2,
    #   entropy = 2 * 1/4 * 2 + 1/2 * 1 = 1.5 bits
    # luma: black 0 < 0.15 (dark), white 1, red 0.299: dark share 1/4
    # chroma (max - min) / 255: black 0, white 0, red 1 (>= 0.5): saturated share 2/4
    # pairs: horizontal (black, white) 255 > 64 edge, (red, red) 0; vertical (black, red) 255,
    #   (white, red) 255: 3 edges of 2 * 1 + 1 * 2 = 4 pairs
    s = image_statistics(_img([[BLACK, WHITE], [RED, RED]]))
    assert s[ENTROPY].tolist() == pytest.approx([1.5], abs=1e-6)
    assert s[DARK].tolist() == [0.25]
    assert s[SATURATED].tolist() == [0.5]
    assert s[EDGES].tolist() == [0.75]


def test_image_statistics_edge_cases():
    one = image_statistics(_img([[RED]]))  # one pixel: one colour, no neighbour pairs
    assert one[ENTROPY].item() == 0.0 and math.isnan(one[EDGES].item())
    assert one[SATURATED].item() == 1.0 and one[DARK].item() == 0.0
    # a 256 px image of alternating black and white columns is read at every 2nd pixel
    # (ceil(256 / 128) = 2): all black, so one colour, all dark, no edge
    cols = torch.zeros(1, 256, 256, 3, dtype=torch.uint8)
    cols[:, :, 1::2] = 255
    s = image_statistics(cols)
    assert (s[ENTROPY].item(), s[DARK].item(), s[EDGES].item()) == (0.0, 1.0, 0.0)
    # a step of exactly EDGE_STEP (64) is no edge, 65 is
    two = torch.tensor([[[[0, 0, 0], [64, 0, 0]]], [[[0, 0, 0], [65, 0, 0]]]], dtype=torch.uint8)
    assert image_statistics(two)[EDGES].tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="uint8"):
        image_statistics(torch.zeros(1, 2, 2, 3))


def test_average_ranks_share_ties():
    # sorted: 1 (rank 1), 2 (rank 2), 3 and 3 (ranks 3 and 4, both 3.5)
    assert average_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]


def test_group_spearman_by_hand():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0] * 4)
    b = torch.cat(
        [
            torch.tensor([10.0, 20.0, 30.0, 40.0]),  # same order: 1
            torch.tensor([4.0, 3.0, 2.0, 1.0]),  # reversed: -1
            torch.tensor([1.0, 1.0, 2.0, 2.0]),  # ties: see below
            torch.tensor([5.0, 5.0, 5.0, 5.0]),  # constant: no ranking, NaN
        ]
    )
    # ties: ranks a = 1..4 (centred -1.5, -0.5, 0.5, 1.5), b = 1.5, 1.5, 3.5, 3.5 (centred
    # -1, -1, 1, 1): covariance 1.5 + 0.5 + 0.5 + 1.5 = 4, norms^2 5 and 4: 4 / sqrt(20)
    rho = group_spearman(a, b, 4)
    assert rho[:3].tolist() == pytest.approx([1.0, -1.0, 4 / math.sqrt(20)], abs=1e-6)
    assert math.isnan(rho[3].item())
    b_nan = b.clone()
    b_nan[0] = float("nan")
    assert math.isnan(group_spearman(a, b_nan, 4)[0].item())  # a lost score: no figure


def test_reward_agreement_means_the_finite_groups():
    a = torch.tensor([1.0, 2.0, 3.0, 1.0, 2.0, 3.0])
    b = torch.tensor([1.0, 2.0, 3.0, 3.0, 2.0, 1.0])  # groups: +1 and -1: mean 0
    c = torch.tensor([2.0, 2.0, 2.0, 1.0, 2.0, 3.0])  # with a: NaN (constant) and +1: 1
    out = reward_agreement({"a": a, "b": b, "c": c}, 3)
    # b vs c: group 1 NaN, group 2 (3, 2, 1) against (1, 2, 3): -1
    assert out == pytest.approx(
        {
            "agreement/a_vs_b": 0.0,
            "agreement/a_vs_c": 1.0,
            "agreement/b_vs_c": -1.0,
            "agreement/mean": 0.0,
        }
    )
    assert reward_agreement({"a": a}, 3) == {}  # one component: nothing to agree with


def test_trend_is_the_least_squares_rise():
    assert trend([0, 1, 2], [0.0, 1.0, 2.0]) == pytest.approx(2.0)
    # slope of (0, 0), (1, 2), (2, 1): mean x 1, mean y 1; sum (x - 1)(y - 1) = 1 * 0 ... =
    # (-1)(-1) + 0 + (1)(0) = 1, sxx = 2: slope 0.5, rise over the span 2: 1.0
    assert trend([0, 1, 2], [0.0, 2.0, 1.0]) == pytest.approx(1.0)
    assert trend([0, 1, 2], [0.0, float("nan"), 4.0]) == pytest.approx(4.0)  # NaN skipped
    assert math.isnan(trend([3], [1.0]))


def _rows(n: int, reward, judge, **extra) -> list[dict]:
    out = []
    history: list[dict] = []
    rules = MonitorRules()
    for s in range(n):
        row = {"step": s, "reward_mean": reward(s), "reward_std": 1.0, "accuracy": judge(s)}
        row.update({k: f(s) for k, f in extra.items()})
        row.update(monitor_figures(history, row, rules))
        history.append(row)
        out.append(row)
    return out


def test_hacking_rule_trips_where_derived():
    # the reward rises 0.1 a step (reward std 1), the judge is flat: over a window of 10 steps
    # the rise is 0.9 > 0.5 and the judge's 0 <= 0, from step 9 (the first full window);
    # it must hold 3 steps in a row: the alarm holds from step 9 + 2 = 11
    rows = _rows(20, lambda s: 0.1 * s, lambda s: 0.3)
    flags = [r.get(ALARM + "hacking") for r in rows]
    assert flags[:9] == [None] * 9  # no full window yet
    assert flags[9:11] == [0.0, 0.0] and set(flags[11:]) == {1.0}
    assert rows[9]["monitor/reward_trend"] == pytest.approx(0.9)
    assert monitor_summary(rows)["alarms"]["hacking"] == {"first_step": 11, "steps": 9}
    # the judge rising with the reward is no hacking, however fast the reward goes
    honest = _rows(20, lambda s: 0.1 * s, lambda s: 0.3 + 0.01 * s)
    assert not any(r.get(ALARM + "hacking") for r in honest)
    assert monitor_summary(honest)["alarms"]["hacking"] == {"first_step": None, "steps": 0}


def test_drift_rule_trips_where_derived():
    # colour entropy 2.0 at steps 0-6, 3.5 from step 7: the baseline (steps 0-4) is 2.0; the
    # last 5 steps' mean is 2.9 at step 9 (drift 0.9 <= 1 bit), 3.2 at step 10 (1.2: trips)
    rows = _rows(12, lambda s: 1.0, lambda s: 0.5, **{ENTROPY: lambda s: 2.0 if s < 7 else 3.5})
    assert ALARM + "drift" not in rows[8]  # the windows overlap before 2 * 5 steps
    assert rows[9]["monitor/drift/colour_entropy"] == pytest.approx(0.9)
    assert [r[ALARM + "drift"] for r in rows[9:]] == [0.0, 1.0, 1.0]
    # it trips once: a later step that holds it is not new
    assert newly_tripped(rows[:10], rows[10]) == ["drift"]
    assert newly_tripped(rows[:11], rows[11]) == []


def test_probe_set_takes_each_tag_in_turn():
    prompts = ["a1", "a2", "b1", "c1", "c2", "a3"]
    tags = ["a", "a", "b", "c", "c", "a"]
    assert probe_set(prompts, tags, 4) == (["a1", "b1", "c1", "a2"], ["a", "b", "c", "a"])
    assert probe_set(prompts, None, 2) == (["a1", "a2"], None)
    assert probe_set(prompts, tags, 99)[0] == ["a1", "b1", "c1", "a2", "c2", "a3"]


# --------------------------------------------------------------------------- toy runs


@register_reward("test_one_colour")
def _one_colour(grid: int = 4, name: str = "test_one_colour"):
    """A reward that pays for red cells, whatever the prompt asks: a hackable proxy."""
    from maskgrpo_ray.worlds.toy.world import COLOUR_NAMES, pixels_to_cells

    red = COLOUR_NAMES.index("red") + 1  # palette index (0 is the background)

    class OneColour:
        def __init__(self) -> None:
            self.name = name

        def __call__(self, images, prompts):
            return (pixels_to_cells(images.cpu(), grid) == red).flatten(1).float().mean(-1)

    return OneColour()


def _toy_run(tmp: Path, reward: str, steps: int) -> list[dict]:
    run = tmp / reward
    sets = [
        f"train.steps={steps}",
        "eval.every_steps=0",
        "eval.samples_per_prompt=4",
        "logging.sample_grid_every_steps=0",
        "logging.progress_bar=false",
        "logging.monitors.probe_every_steps=5",
        "run.export_final_policy=false",
        "run.checkpoint_every_steps=0",
        "run.checkpoint_every_minutes=0",
        f"reward.components=[{{kind: {reward}, weight: 1.0}}"
        + (", {kind: toy_rules, weight: 0.0}]" if reward != "toy_rules" else "]"),
    ]
    args = ["train", "--config", "configs/toy.yaml", "--backend", "local", "--run-dir", str(run)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    assert (run / "monitors.png").exists()
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(600)
def test_a_reward_for_one_colour_trips_the_alarm_and_the_rules_do_not(tmp_path, caplog):
    hacked = _toy_run(tmp_path, "test_one_colour", 40)
    first = monitor_summary(hacked)["alarms"]["hacking"]["first_step"]
    assert first is not None and first <= 30, [r.get("monitor/reward_trend") for r in hacked]
    assert "monitor alarm 'hacking' tripped at step" in caplog.text
    # the judge and the paid reward disagree within the groups; both are logged
    assert "agreement/test_one_colour_vs_toy_rules" in hacked[-1]
    honest = _toy_run(tmp_path, "toy_rules", 40)
    alarms = monitor_summary(honest)["alarms"]
    assert all(a["first_step"] is None for a in alarms.values()), alarms
