"""``maskgrpo train``'s ending: a few lines a person reads; the JSON only with ``--json``."""

from __future__ import annotations

import json

from maskgrpo_ray.cli import app, main
from maskgrpo_ray.cli.ending import ending_lines

SUMMARY = {
    "completed": True,
    "eval_prompts": 24,
    "eval_samples_per_prompt": 32,
    "base_eval": {
        "eval_accuracy": 0.328125,
        "eval_reward": 1.1453,
        "eval_diversity/distinct": 0.5885,
    },
    "final_eval": {
        "eval_accuracy": 0.95573,
        "eval_reward": 1.9435,
        "eval_diversity/distinct": 0.0625,
    },
}


def test_the_ending_names_the_figures_the_folder_and_what_next(tmp_path):
    (tmp_path / "samples").mkdir()
    (tmp_path / "reward_curve.png").write_bytes(b"")
    (tmp_path / "samples" / "eval_tags_final.png").write_bytes(b"")
    lines = ending_lines(SUMMARY, tmp_path)
    assert lines[0] == "evaluated on 24 held-out prompts, 32 samples each:"
    # 0.328125 -> 0.33, 1.1453 -> 1.15, 0.5885 -> 0.59; 0.95573 -> 0.96, 0.0625 -> 0.06 (round
    # half to even on the binary value 0.0625 exactly)
    assert lines[1] == "  base model  accuracy 0.33  reward 1.15  distinct images 0.59"
    assert lines[2] == "  tuned model accuracy 0.96  reward 1.94  distinct images 0.06"
    assert lines[3] == f"every figure: {tmp_path / 'summary.json'}"
    pictures = f"{tmp_path / 'reward_curve.png'}, {tmp_path / 'samples/eval_tags_final.png'}"
    assert lines[4] == f"pictures: {pictures}"  # monitors.png was not written: not named
    assert lines[5].startswith(f"next: maskgrpo eval --weights base --weights {tmp_path}")
    assert lines[-1] == f"run directory: {tmp_path}"
    assert len(lines) == 8


def test_a_run_without_accuracy_or_pictures_stopped_early(tmp_path):
    summary = {
        "completed": False,
        "stopped_by": "SIGTERM",
        "base_eval": {"eval_reward": 0.2},
        "final_eval": {},
    }
    lines = ending_lines(summary, tmp_path)
    assert lines == [
        "evaluated on held-out prompts:",
        "  base model  accuracy n/a  reward 0.20",
        "  tuned model accuracy n/a  reward n/a",
        f"every figure: {tmp_path / 'summary.json'}",
        "stopped early by SIGTERM; run the same command to resume",
        f"run directory: {tmp_path}",
    ]


def test_train_prints_the_ending_and_the_json_only_when_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(app, "run_train", lambda cfg, run_dir, *a, **k: dict(SUMMARY))
    run = tmp_path / "run"
    argv = ["train", "--config", "toy", "--backend", "local", "--run-dir", str(run)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "{" not in out and out.splitlines() == ending_lines(SUMMARY, run)
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    head, _, tail = out.partition("\n}\n")
    assert json.loads(head + "\n}") == SUMMARY
    assert tail.splitlines() == ending_lines(SUMMARY, run)
