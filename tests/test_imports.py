"""maskgrpo_ray.algo stays pure math: no ray, deepspeed or torch.distributed imports; the config
tree (and the schemas it reads) imports no torch, no scorer and no ray."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ALGO = Path(__file__).resolve().parents[1] / "maskgrpo_ray" / "algo"
FORBIDDEN = ("ray", "deepspeed", "torch.distributed", "maskgrpo_ray.config")


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
    return out


def test_algo_sources_import_nothing_forbidden():
    files = sorted(ALGO.glob("*.py"))
    assert len(files) >= 6
    for f in files:
        for name in _imports(f):
            assert not any(name == x or name.startswith(x + ".") for x in FORBIDDEN), (f, name)


def test_algo_import_loads_no_ray_or_deepspeed():
    # torch itself loads some torch.distributed submodules, so only ray/deepspeed are checked here
    code = (
        "import sys, maskgrpo_ray.algo.sampling, maskgrpo_ray.algo.transition, "
        "maskgrpo_ray.algo.grpo, maskgrpo_ray.algo.filtering, maskgrpo_ray.algo.schedule\n"
        "heavy = [m for m in ('ray', 'deepspeed', 'maskgrpo_ray.config') if m in sys.modules]\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_actors_and_learner_install_under_the_package_namespace(tmp_path):
    # outside the repository (so its folders are not on sys.path) the installed package exposes
    # maskgrpo_ray.actors / maskgrpo_ray.learner and no top-level `actors` or `learner`
    code = (
        "import importlib.util as u, maskgrpo_ray.actors.rollout, maskgrpo_ray.learner.group\n"
        "print(u.find_spec('actors'), u.find_spec('learner'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None"]


# a meta-path finder that refuses the heavy packages, as on a machine without them
REFUSE_HEAVY = (
    "import sys\n"
    "class Refuse:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('torch', 'torchvision', 'open_clip', 'ray'):\n"
    "            raise ImportError(f'refused in this test: {name}')\n"
    "sys.meta_path.insert(0, Refuse())\n"
)


def test_config_imports_without_torch_scorers_or_ray():
    code = REFUSE_HEAVY + (
        "try:\n"
        "    import torch\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    sys.exit('the finder did not refuse torch')\n"
        "import maskgrpo_ray.config, maskgrpo_ray.config.docs, maskgrpo_ray.prompts.geneval_schema\n"
        "from maskgrpo_ray.config import Config, ToyModelConfig, load_config\n"
        "from maskgrpo_ray.config.metrics import MetricSpec\n"
        "assert maskgrpo_ray.config.docs.render_config_docs().startswith('# Configuration')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
