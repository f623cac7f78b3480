"""bench/bench_gpu.py: its ``--smoke`` run (tiny random Show-o) writes every section.

The CPU run goes through the command line in a subprocess, as a user types it; the ``gpu`` test
runs the same smoke configuration on CUDA in-process (CI has no CUDA: it is skipped there); the
``slow`` one adds the Ray weight-sync section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from maskgrpo_ray.models.showo import build_tiny_random_policy

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "bench_gpu.py"
SECTIONS = ("meta", "rollout", "fidelity", "learner", "mfu", "weight_sync", "summary")
# the tiny policy: hidden 64, 2 layers, 4 heads (head_dim 16), MLP 256, text prompt P = 16 + 1
TINY_LAYER = 2 * 64 + 4 * (64 * 64 + 64) + 2 * 2 * 16 + (64 * 256 + 256) + (256 * 64 + 64)
TINY_BODY = 2 * TINY_LAYER + 2 * 64  # two layers and the final LayerNorm = 99968
TINY_HEAD = 64 * (64 + 1)  # lm_head rows of the 64 codebook entries, with bias


def _run_cli(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "bench_gpu.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "### summary" in proc.stdout
    return json.loads(out.read_text())


def _check_smoke(results: dict) -> None:
    """Every section present; every configuration of the smoke grid measured, none skipped."""
    assert set(SECTIONS) <= set(results)
    rollout = results["rollout"]["rows"]
    assert len(rollout) == 2 * 2 * 2  # shapes x batch sizes (6, 12) x likelihoods
    assert all(r["images_per_s"] > 0 and r["decode_s"] > 0 for r in rollout)
    learner = results["learner"]["rows"]
    assert len(learner) == 2 * 2 * 2  # shapes x likelihoods x micro-batches (4, 8)
    assert all(r["pairs"] == 6 * 2 and r["pairs_per_s"] > 0 for r in learner)  # G x 2 steps
    # one prompt: one text prefix per micro-batch, ceil(12 / micro_batch) of them
    assert all(r["text_prefixes"] == -(-12 // r["micro_batch"]) for r in learner)
    fidelity = results["fidelity"]["rows"]
    assert [r["kind"] for r in fidelity] == ["p1 marginal", "p1 eq14", "p2"] * 2
    # float32, same weights: the recomputation in micro-batches of 4 reproduces the rollout's
    # log-probs up to float32 rounding of sums over at most L = 64 positions (about 1e-5)
    assert all(r["max"] < 1e-3 for r in fidelity), fidelity
    flops = results["mfu"]["flop_model"]
    assert (flops["body_params"], flops["head_params"], flops["text_len"]) == (
        TINY_BODY,
        TINY_HEAD,
        17,
    )
    # a rollout row's rate times its time is the hand count: 2 x (N S image passes of L + 2
    # rows through the layers and L rows through the head + N / G text prefixes of P rows)
    r = rollout[0]
    want = 2 * (r["N"] * r["S"] * (TINY_BODY * (r["L"] + 2) + TINY_HEAD * r["L"]))
    want += 2 * (r["N"] // 6) * TINY_BODY * 17
    assert r["tflops_per_s"] * 1e12 * r["seconds"] == pytest.approx(want, rel=1e-9)
    assert len(results["summary"]["rows"]) == 2


def test_smoke_run_on_cpu_writes_every_section(tmp_path):
    results = _run_cli(tmp_path, "--no-ray")
    _check_smoke(results)
    assert results["weight_sync"] == {"skipped": "--no-ray"}
    assert results["meta"]["device"] == "cpu"


@pytest.mark.slow
def test_smoke_run_with_ray_weight_sync(tmp_path):
    results = _run_cli(tmp_path)
    _check_smoke(results)
    sync = results["weight_sync"]
    policy = build_tiny_random_policy(0)
    trained = [p for p in policy.parameters() if p.requires_grad]  # the transformer, float32
    assert sync["bytes"] == sum(p.numel() * 4 for p in trained)
    assert sync["tensors"] == len(trained)
    assert len(sync["pushes"]) == 2 and sync["gb_per_s"] > 0


def _load_bench():
    """The script as a module, in this process, loaded as model plugin files are: it goes
    into ``sys.modules`` before it runs (its dataclasses, with postponed annotations, look their
    module up there, and so does its ``register_pickle_by_value``)."""
    from maskgrpo_ray.config.kinds import import_file

    import_file(SCRIPT)
    return sys.modules[SCRIPT.stem]


def test_script_loads_in_process():
    """What the ``gpu`` test below does first, checked without CUDA: the script loads as a
    module and parses the smoke run's arguments (it once failed on its dataclasses here)."""
    bench = _load_bench()
    args = bench.parse_args(["--smoke", "--device", "cuda", "--no-ray", "--out", "x.json"])
    assert args.smoke and args.no_ray and args.device == "cuda"


@pytest.mark.gpu
def test_smoke_run_on_cuda(tmp_path):
    bench = _load_bench()
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 matmuls: the 1e-3 bound above
    try:
        out = tmp_path / "bench_gpu.json"
        args = bench.parse_args(["--smoke", "--device", "cuda", "--no-ray", "--out", str(out)])
        results = bench.run(args)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert results is not None and json.loads(out.read_text()).keys() == results.keys()
    _check_smoke(results)
    assert results["meta"]["device"].startswith("cuda")
    assert all(r["peak_mem_gib"] > 0 for r in results["learner"]["rows"])
