"""maskgrpo_ray.algo stays pure math: importing it pulls in no ray, deepspeed or distributed."""

from __future__ import annotations

import subprocess
import sys


def test_algo_import_is_clean():
    code = (
        "import sys, maskgrpo_ray.algo.sampling, maskgrpo_ray.algo.transition, "
        "maskgrpo_ray.algo.grpo, maskgrpo_ray.algo.filtering, maskgrpo_ray.algo.schedule\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'deepspeed') "
        "or m.startswith('torch.distributed.') and m != 'torch.distributed']\n"
        "heavy = [m for m in ('ray', 'deepspeed', 'maskgrpo_ray.config') if m in sys.modules]\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
