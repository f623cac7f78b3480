"""GenEval's scorer wired into runs, on a tiny random Show-o and tiny random Mask2Former and
open_clip (no download; the numbers mean nothing, the wiring is proven): the evaluation inside a
run reports GenEval per tag and overall (eval.geneval), a Ray run trains on the ``geneval``
reward end to end, and ``maskgrpo eval`` scores with it."""

from __future__ import annotations

import json
import logging

import pytest

from maskgrpo_ray.cli import main
from maskgrpo_ray.prompts.geneval_schema import GENEVAL_CLASSES, TAGS
from maskgrpo_ray.rewards.geneval_colour import save_tiny_clip_folder
from maskgrpo_ray.rewards.geneval_detector import save_tiny_random_mask2former

D2 = {"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Tiny models and two disjoint GenEval prompt files (one prompt per tag to evaluate)."""
    root = tmp_path_factory.mktemp("geneval_runs")
    det = save_tiny_random_mask2former(root / "det", [D2.get(c, c) for c in GENEVAL_CLASSES])
    clip = save_tiny_clip_folder(root / "clip")
    assert main(["prompts", "make", "--kind", "geneval", "--n", "6", "--seed", "1",
                 "--out", str(root / "eval.jsonl")]) == 0  # fmt: skip
    assert main(["prompts", "make", "--kind", "geneval", "--n", "12", "--seed", "0",
                 "--exclude", str(root / "eval.jsonl"), "--out", str(root / "train.jsonl")]) == 0  # fmt: skip
    args = {"detector": det, "colour_model": clip, "colour_pretrained": None,
            "detector_scale": [64, 48], "batch_size": 4}  # fmt: skip
    return root, args


@pytest.fixture(scope="module")
def judge(world):
    """eval.geneval's scorer with a second tiny detector: a judge the reward does not use."""
    root, args = world
    other = save_tiny_random_mask2former(
        root / "det_judge", [D2.get(c, c) for c in GENEVAL_CLASSES], seed=1
    )
    return {**args, "detector": other}


def overrides(root, args, *more):
    return [
        "--set", f"data.prompts={root / 'train.jsonl'}",
        "--set", f"data.eval_prompts={root / 'eval.jsonl'}",
        "--set", "logging.progress_bar=false",
        "--set", "train.steps=1",
        *[x for m in more for x in ("--set", m)],
    ]  # fmt: skip


def test_in_run_evaluation_reports_geneval_per_tag_and_overall(world, tmp_path):
    root, args = world
    run = tmp_path / "run"
    clip = {"kind": "clip", "weight": 1.0,
            "args": {"model_name": args["colour_model"], "pretrained": None}}  # fmt: skip
    code = main(["train", "--config", "configs/showo_tiny_random.yaml", "--backend", "local",
                 "--run-dir", str(run),
                 *overrides(root, args, f"eval.geneval={json.dumps(args)}",
                            f"reward.components=[{json.dumps(clip)}]")])  # fmt: skip
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    for ev in (summary["base_eval"], summary["final_eval"]):  # the CLIP run's GenEval
        per_tag = [ev[f"eval_accuracy/{tag}"] for tag in TAGS]  # one eval prompt per tag
        assert all(0.0 <= v <= 1.0 for v in per_tag)  # NaN fails: every tag judged
        assert ev["eval_accuracy/tag_mean"] == pytest.approx(sum(per_tag) / len(TAGS))
    assert (run / "samples" / "eval_tags_base.png").exists()


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(300)
def test_a_ray_run_trains_on_the_geneval_reward(world, judge, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    root, args = world
    run = tmp_path / "run"
    comp = {"kind": "geneval", "weight": 1.0, "args": args}
    code = main(["train", "--config", "configs/showo_tiny_random.yaml", "--run-dir", str(run),
                 *overrides(root, args, f"reward.components=[{json.dumps(comp)}]",
                            f"eval.geneval={json.dumps(judge)}", "train.steps=2")])  # fmt: skip
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["backend"] == "ray" and summary["policy_version"] == 2
    assert summary["geneval_detectors"] == {
        "reward/geneval": args["detector"],
        "eval_accuracy": judge["detector"],
    }
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["reward_failures/geneval/raised"] == 0 for r in rows)
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows if "reward_mean" in r)


def test_maskgrpo_eval_scores_geneval_with_the_scorer(world, tmp_path):
    root, args = world
    out = tmp_path / "eval"
    code = main(["eval", "--config", "configs/showo_tiny_random.yaml", "--weights", "base",
                 "--prompts", str(root / "eval.jsonl"), "--backend", "local", "--out", str(out),
                 "--set", f"eval.geneval={json.dumps(args)}",
                 "--set", "eval.samples_per_prompt=2"])  # fmt: skip
    assert code == 0
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 6 * 2 and {r["tag"] for r in rows} == set(TAGS)
    assert all(r["scores"]["geneval"] in (0.0, 1.0) for r in rows)  # judged, none lost
    assert all((out / r["image_path"]).is_file() for r in rows)  # the evaluator's folder
    report = json.loads((out / "report.json").read_text())
    assert "geneval" in report["per_tag"]


def test_a_geneval_reward_is_judged_by_another_detector(world, judge, tmp_path):
    """The local backend's in-run evaluation scores GenEval with eval.geneval's detector, not
    the reward's, and the summary says which scored what."""
    root, args = world
    run = tmp_path / "run"
    comp = {"kind": "geneval", "weight": 1.0, "args": args}
    code = main(["train", "--config", "configs/showo_tiny_random.yaml", "--backend", "local",
                 "--run-dir", str(run),
                 *overrides(root, args, f"reward.components=[{json.dumps(comp)}]",
                            f"eval.geneval={json.dumps(judge)}")])  # fmt: skip
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["geneval_detectors"] == {
        "reward/geneval": args["detector"],
        "eval_accuracy": judge["detector"],
    }
    per_tag = [summary["final_eval"][f"eval_accuracy/{tag}"] for tag in TAGS]
    assert all(0.0 <= v <= 1.0 for v in per_tag)  # the judge scored every tag


def test_training_and_judging_with_one_detector_warns_once(world, caplog, capsys):
    root, args = world
    comp = {"kind": "geneval", "weight": 1.0, "args": args}
    caplog.set_level(logging.WARNING)
    code = main(["validate", "--config", "configs/showo_tiny_random.yaml",
                 *overrides(root, args, f"reward.components=[{json.dumps(comp)}]",
                            f"eval.geneval={json.dumps(args)}")])  # fmt: skip
    assert code == 0
    lines = [r.getMessage() for r in caplog.records if "eval.geneval.detector" in r.getMessage()]
    assert len(lines) == 1 and "the detector the policy trains against" in lines[0]
    assert "\n" not in lines[0]


def test_a_geneval_reward_without_a_judge_wants_the_official_detector(
    world, tmp_path, monkeypatch, capsys
):
    """eval.geneval unset: the judge is its default, ``official``; not converted yet, the run
    stops before anything starts, with one line naming the converter."""
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path))
    root, args = world
    comp = {"kind": "geneval", "weight": 1.0, "args": args}
    code = main(["validate", "--config", "configs/showo_tiny_random.yaml",
                 *overrides(root, args, f"reward.components=[{json.dumps(comp)}]")])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "maskgrpo geneval convert-detector" in err and "official" in err
