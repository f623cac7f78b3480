"""A feature whose optional package is missing ends in one line naming the pip extra (or, for
ImageReward, the ``--no-deps`` install a pip user can follow), before anything starts.

"Missing" is made in-process: ``sys.modules[name] = None`` makes ``import name`` fail and
``find_spec(name)`` answer None, as on a machine without the package.
"""

from __future__ import annotations

import sys

import pytest

from maskgrpo_ray.cli import main
from maskgrpo_ray.extras import EXTRAS, NODEPS_INSTALL, MissingExtra, require


def _one_line(capsys) -> str:
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_parquet_prompts_without_pyarrow_name_the_parquet_extra(tmp_path, monkeypatch, capsys):
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    code = main(["prompts", "check", str(tmp_path / "p.parquet")])
    line = _one_line(capsys)
    assert code == 2
    assert line.startswith("maskgrpo: the Parquet prompt file ") and "p.parquet" in line
    assert line.endswith("pip install 'maskgrpo-ray[parquet]'"), line


def test_the_fid_metric_without_torch_fidelity_names_the_fid_extra(tmp_path, monkeypatch):
    from maskgrpo_ray.config.metrics import MetricSpec
    from maskgrpo_ray.evaluation.metric_files import check_metric_files

    (tmp_path / "inception.pth").write_bytes(b"x")
    spec = MetricSpec(kind="fid", weights=str(tmp_path / "inception.pth"), reference_dir="/r")
    monkeypatch.setitem(sys.modules, "torch_fidelity", None)
    with pytest.raises(MissingExtra, match=r"eval\.metrics\[0\] \(kind=fid\) needs") as err:
        check_metric_files(spec, "eval.metrics[0]")
    assert str(err.value).endswith("pip install 'maskgrpo-ray[fid]'")


def test_s3_storage_without_s3fs_names_the_s3_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "s3fs", None)
    code = main(["validate", "--set", "run.storage=s3://bucket/runs/x"])
    line = _one_line(capsys)
    assert code == 2 and "run.storage='s3://bucket/runs/x'" in line, line
    assert "pip install 'maskgrpo-ray[s3]'" in line


def test_imagereward_missing_gives_the_no_deps_install_a_pip_user_can_run(monkeypatch):
    from maskgrpo_ray.rewards._imagereward_compat import installed_spec

    assert NODEPS_INSTALL == "pip install --no-deps image-reward==1.5 fairscale==0.4.13"
    monkeypatch.setitem(sys.modules, "ImageReward", None)
    with pytest.raises(ImportError) as err:
        installed_spec()
    assert NODEPS_INSTALL in str(err.value) and "requirements" not in str(err.value)
    monkeypatch.delitem(sys.modules, "ImageReward")
    monkeypatch.setitem(sys.modules, "fairscale", None)  # image-reward alone: BLIP needs it
    with pytest.raises(ImportError, match="fairscale is not"):
        installed_spec()


def test_require_names_only_its_own_package_as_missing(tmp_path, monkeypatch):
    with pytest.raises(KeyError):
        require("matplotlib", "plots")  # a core dependency, not an extra's
    # an installed optional package that fails inside (a broken install) is not "missing"
    pkg = tmp_path / "s3fs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import no_such_module_inside\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "s3fs", raising=False)
    with pytest.raises(ModuleNotFoundError) as err:
        require("s3fs", "s3 storage")
    assert not isinstance(err.value, MissingExtra) and err.value.name == "no_such_module_inside"
    assert set(EXTRAS.values()) == {"parquet", "fid", "trackers", "s3"}
