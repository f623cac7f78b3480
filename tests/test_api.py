"""The Python API (``maskgrpo_ray.api``, re-exported lazily by ``maskgrpo_ray``): the commands'
own paths, the same answers, and ``docs/api_example.py`` run as a user runs it. Hub-id
resolution through ``maskgrpo_ray.train`` is checked against a stand-in hub in
``tests/test_hub.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import maskgrpo_ray as mg
from maskgrpo_ray import api
from maskgrpo_ray.cli import app as cli
from maskgrpo_ray.cli import main
from maskgrpo_ray.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
REFUSE_HEAVY = (  # as tests/test_imports.py: a machine without torch and ray
    "import sys\n"
    "class Refuse:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('torch', 'torchvision', 'open_clip', 'ray'):\n"
    "            raise ImportError(f'refused in this test: {name}')\n"
    "sys.meta_path.insert(0, Refuse())\n"
)


def test_import_maskgrpo_ray_stays_light_and_the_api_loads_on_first_use():
    code = REFUSE_HEAVY + (
        "import maskgrpo_ray as mg\n"
        "assert 'maskgrpo_ray.api' not in sys.modules\n"
        "plan = mg.plan('showo_512_h100', gpus=16)\n"  # the cost model: no torch
        "assert 'maskgrpo_ray.api' in sys.modules and callable(mg.train)\n"
        "print(plan['recommended']['rollout_gpus'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) >= 1
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        _ = mg.trian  # type: ignore[attr-defined]


def test_plan_is_the_commands_json(capsys):
    assert main(["plan", "--model", "showo", "--resolution", "256", "--gpus", "8", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert mg.plan(model="showo", resolution=256, gpus=8) == printed
    with pytest.raises(ValueError, match="not a built-in profile"):
        mg.plan("nosuch")


def test_overrides_as_a_dict_read_as_the_same_set_items():
    as_dict = mg.load_config(
        "toy",
        {
            "model.lora": {"rank": 8, "alpha": 16},
            "train.learning_rate": 3e-3,
            "run.name": "my run",
            "eval.metrics": [],
            "data.eval_prompts": None,
        },
    )
    as_items = mg.load_config(
        "toy",
        [
            "model.lora={rank: 8, alpha: 16}",
            "train.learning_rate=3e-3",
            "run.name=my run",
            "eval.metrics=[]",
            "data.eval_prompts=null",
        ],
    )
    assert as_dict == as_items and as_dict.model.lora is not None
    assert mg.load_config(as_dict) == as_dict  # a Config goes back in as it is
    with pytest.raises(TypeError, match="list of 'key=value'"):
        mg.load_config("toy", "train.steps=3")  # type: ignore[arg-type]


def test_train_runs_the_commands_path_and_returns_the_summary(tmp_path, monkeypatch):
    seen = []

    def run_train(cfg, run_dir, resume_from=None, prompts=None):
        seen.append((cfg.model_dump(mode="json"), run_dir, resume_from, len(prompts.train)))
        return {"steps": cfg.train.steps, "completed": True}

    monkeypatch.setattr(cli, "run_train", run_train)
    out = mg.train("toy", {"train.steps": 3}, run_dir=tmp_path / "a", backend="local")
    assert out == {"steps": 3, "completed": True, "run_dir": str(tmp_path / "a")}
    assert main(["train", "--config", "toy", "--set", "train.steps=3", "--backend", "local",
                 "--run-dir", str(tmp_path / "a")]) == 0  # fmt: skip
    (api_cfg, api_dir, api_from, n), (cli_cfg, cli_dir, cli_from, m) = seen
    assert api_cfg == cli_cfg and api_cfg["run"]["backend"] == "local"
    assert (api_dir, api_from, n) == (cli_dir, cli_from, m) and n > 0


def test_a_bad_input_raises_one_user_error_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "run_train", lambda *a, **k: pytest.fail("the run started"))
    with pytest.raises(UserError, match="rollout.samples_per_prompt"):
        mg.train("toy", {"rollout.samples_per_prompt": 1}, run_dir=tmp_path / "r")
    with pytest.raises(UserError, match="no such file; the built-in configs are"):
        mg.train("configs/nosuch.yaml")
    with pytest.raises(UserError, match="no complete checkpoint there"):
        mg.train(resume=tmp_path / "never_ran")
    with pytest.raises(UserError, match=r"--weights: labels \['x', 'x'\] repeat"):
        mg.evaluate(["x=base", "x=base"], config="toy")
    assert not (tmp_path / "r").exists()


def test_every_api_keyword_is_an_argument_of_its_command():
    # api._namespace refuses a keyword the command's parser lacks; the commands' defaults hold
    from maskgrpo_ray.cli import plan as plan_cli
    from maskgrpo_ray.evaluation import cli as eval_cli

    args = api._namespace(eval_cli.register, "eval", prompts="p.txt")
    assert args.prompts == "p.txt" and args.weights == [] and args.metric == []
    assert api._namespace(plan_cli.add_parser, "plan").gpus == 16
    with pytest.raises(AssertionError, match="no argument 'nosuch'"):
        api._namespace(plan_cli.add_parser, "plan", nosuch=1)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(600)
def test_the_api_example_runs_and_its_evaluation_reproduces_the_runs_figures(tmp_path):
    """``docs/api_example.py`` from a folder outside the repository: train, evaluate, plan.
    The evaluation of base and tuned uses the run's evaluation settings (2 samples per prompt,
    the run's seed), so its accuracies are the run's own base and final ones."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "api_example.py"), str(tmp_path / "work")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "config: toy model, G=6, B=4", lines
    summary = json.loads((tmp_path / "work" / "run" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["completed"] is True
    report = json.loads((tmp_path / "work" / "eval" / "summary.json").read_text())
    assert report["base"]["accuracy"] == pytest.approx(summary["base_accuracy"], abs=1e-6)
    assert report["tuned"]["accuracy"] == pytest.approx(summary["final_accuracy"], abs=1e-6)
    tuned = f"eval tuned: accuracy {summary['final_accuracy']:.3f}, reward "
    assert any(line.startswith(tuned) for line in lines), lines
    assert (tmp_path / "work" / "eval" / "report.md").is_file()
    assert lines[-1].startswith("plan: 4 rollout + 12 learner GPUs"), lines
