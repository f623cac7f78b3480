"""Where a run goes: absolute always; inside a Ray job's uploaded working directory (which Ray
deletes with the job's package) the default goes to a lasting folder and a relative path is
refused in one line before anything starts. The real job: tests/test_job_faults.py."""

from __future__ import annotations

from pathlib import Path

from maskgrpo_ray.cli import main
from maskgrpo_ray.cli.run_folder import RUNS_ENV, ray_job_working_dir, resolve_run_dir
from maskgrpo_ray.config import load_config


def _job_dir(tmp_path: Path) -> Path:
    """A folder laid out as Ray unpacks a job's working_dir."""
    pkg = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_ab12"
    (pkg / "configs").mkdir(parents=True)
    return pkg


def test_the_job_working_dir_is_recognised_from_inside_it(tmp_path):
    pkg = _job_dir(tmp_path)
    assert ray_job_working_dir(pkg / "configs") == pkg.resolve()
    assert ray_job_working_dir(pkg) == pkg.resolve()
    assert ray_job_working_dir(tmp_path) is None
    lookalike = tmp_path / "working_dir_files_not" / "_ray_pkg_x"
    lookalike.mkdir(parents=True)
    assert ray_job_working_dir(lookalike) is None


def test_a_run_in_a_job_dir_goes_to_the_lasting_root_and_is_absolute(tmp_path, monkeypatch):
    cfg = load_config("toy")
    monkeypatch.chdir(tmp_path)
    outside = resolve_run_dir(cfg, None)
    assert outside.is_absolute() and outside.parent == (tmp_path / "runs").resolve()
    assert resolve_run_dir(cfg, "mine") == (tmp_path / "mine").resolve()
    monkeypatch.chdir(_job_dir(tmp_path))
    monkeypatch.setenv(RUNS_ENV, str(tmp_path / "lasting"))
    inside = resolve_run_dir(cfg, None)
    assert inside.parent == (tmp_path / "lasting").resolve() and inside.name.startswith("toy-")
    monkeypatch.delenv(RUNS_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_run_dir(cfg, None).parent == (tmp_path / "home" / "maskgrpo-runs").resolve()


def test_a_relative_path_in_a_job_dir_is_refused_before_anything_starts(
    tmp_path, monkeypatch, capsys
):
    pkg = _job_dir(tmp_path)
    monkeypatch.chdir(pkg)
    for args, field in (
        (["--run-dir", "runs/x"], "--run-dir runs/x"),
        (["--set", "run.run_dir=out"], "run.run_dir out"),
        (["--set", "run.storage=ckpts"], "run.storage='ckpts'"),
    ):
        assert main(["train", "--config", "toy", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and field in err[0] and "absolute path" in err[0], err
    assert sorted(p.name for p in pkg.iterdir()) == ["configs"]  # nothing written
