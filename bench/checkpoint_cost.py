"""What a checkpoint costs: measured on the toy, predicted for Show-o 512.

    .venv/bin/python -m bench.checkpoint_cost [--steps 40] [--every 5] [--out FILE]
        [--state-gb 20.27] [--device cpu|cuda] [--only-state]

``run.checkpoint_async``: the toy is also run on the local backend with asynchronous
checkpoints (the snapshot on the step's path and the background write timed apart), and a state
dict of ``--state-gb`` GB (Show-o 512's learner state by default: 1.448B parameters, bf16 weights,
fp32 masters and Adam moments; on ``--device``) is snapshotted into host memory
(``loop.snapshot.host_copy``: pinned memory from a GPU) and written through
``storage.CheckpointStore.save`` (files, manifest sha256, fsync, publish), each timed: what the
step loop waits for against what the background writer takes. It needs twice the state in
host memory (the state and its snapshot; on a GPU, the state is on the device).

Runs ``configs/toy.yaml`` on each backend (Ray: one rollout, one reward actor, one DeepSpeed
rank; local) with a checkpoint every ``--every`` steps, times every ``Checkpoints.save`` (the
executor's files, ``driver.pt``, the manifest's sha256 pass, the publish) and sizes what it
wrote, and times the steps. Then measures this machine's sha256 and write+fsync rates on 256
MiB and puts the Show-o 512 checkpoint's bytes (``cost_model.checkpoint_bytes``: 1.448B
parameters in bf16 with Adam and fp32 masters) through ``cost_model.CheckpointRates``: the
stated cluster rates, and the same with this machine's hash and disk rates. The toy's figure is
the per-checkpoint fixed cost (its 0.9 MB take no time); Show-o's is bandwidth.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RAY = [
    "rollout.num_actors=1",
    "reward.num_actors=1",
    "learner.num_workers=1",
    "rollout.num_cpus_per_actor=0.25",
    "reward.num_cpus_per_actor=0.25",
    "learner.num_cpus_per_worker=0.25",
]


def measure_run(backend: str, run_dir: Path, steps: int, every: int) -> dict[str, Any]:
    """One toy run with every checkpoint timed and sized (a wrapper around Checkpoints.save)."""
    from maskgrpo_ray.cli import main
    from maskgrpo_ray.loop import recovery

    saves: list[tuple[float, int]] = []
    real = recovery.Checkpoints.save

    def timed(self: Any, next_step: int, *args: Any, **kw: Any) -> None:
        t0 = time.perf_counter()
        real(self, next_step, *args, **kw)
        took = time.perf_counter() - t0
        folder = run_dir / "checkpoints" / f"step_{next_step:06d}"
        saves.append((took, sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())))

    recovery.Checkpoints.save = timed  # type: ignore[method-assign]
    try:
        args = ["train", "--config", str(ROOT / "configs" / "toy.yaml"), "--backend", backend]
        sets = [f"train.steps={steps}", f"run.checkpoint_every_steps={every}"]
        sets += ["run.checkpoint_every_minutes=0", "logging.progress_bar=false"]
        for s in sets + (RAY if backend == "ray" else []):
            args += ["--set", s]
        assert main([*args, "--run-dir", str(run_dir)]) == 0
    finally:
        recovery.Checkpoints.save = real  # type: ignore[method-assign]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(r["step_seconds"] for r in rows)
    seconds = [s for s, _ in saves]
    return {
        "backend": backend,
        "checkpoints": len(saves),
        "bytes": saves[-1][1],
        "seconds_median": statistics.median(seconds),
        "seconds_max": max(seconds),
        "step_seconds_median": step_s,
        "steps_per_checkpoint_cost": statistics.median(seconds) / step_s,
    }


def measure_async_toy(run_dir: Path, steps: int, every: int) -> dict[str, Any]:
    """The toy on the local backend with ``run.checkpoint_async``: each save's seconds on the
    step loop's path (the snapshot) and each background write's seconds."""
    from maskgrpo_ray.cli import main
    from maskgrpo_ray.loop import recovery, snapshot

    path_s: list[float] = []
    write_s: list[float] = []
    real_save, real_submit = recovery.Checkpoints.save, snapshot.BackgroundWriter.submit

    def timed_save(self: Any, *args: Any, **kw: Any) -> None:
        self.writer.wait()  # the wait for the previous write is not the snapshot's
        t0 = time.perf_counter()
        real_save(self, *args, **kw)
        path_s.append(time.perf_counter() - t0)

    def timed_submit(self: Any, write: Any, what: str) -> None:
        def timed() -> None:
            t0 = time.perf_counter()
            write()
            write_s.append(time.perf_counter() - t0)

        real_submit(self, timed, what)

    recovery.Checkpoints.save = timed_save  # type: ignore[method-assign]
    snapshot.BackgroundWriter.submit = timed_submit  # type: ignore[method-assign]
    try:
        args = ["train", "--config", str(ROOT / "configs" / "toy.yaml"), "--backend", "local"]
        sets = [f"train.steps={steps}", f"run.checkpoint_every_steps={every}"]
        sets += ["run.checkpoint_every_minutes=0", "logging.progress_bar=false"]
        for s in [*sets, "run.checkpoint_async=true"]:
            args += ["--set", s]
        assert main([*args, "--run-dir", str(run_dir)]) == 0
    finally:
        recovery.Checkpoints.save = real_save  # type: ignore[method-assign]
        snapshot.BackgroundWriter.submit = real_submit  # type: ignore[method-assign]
    return {
        "backend": "local, run.checkpoint_async",
        "checkpoints": len(path_s),
        "path_seconds_median": statistics.median(path_s),
        "write_seconds_median": statistics.median(write_s),
    }


def measure_state(folder: Path, gb: float, device: str, chunk_mb: int = 256) -> dict[str, Any]:
    """A state dict of ``gb`` GB on ``device`` (bf16 chunks of ``chunk_mb`` MiB): the snapshot
    into host memory and the whole write through ``CheckpointStore.save``, timed."""
    import torch

    from maskgrpo_ray.checkpoints.storage import CheckpointStore
    from maskgrpo_ray.loop.snapshot import host_copy

    nbytes, chunk = int(gb * 1e9), chunk_mb << 20
    state = {}
    for i in range(0, nbytes, chunk):
        n = min(chunk, nbytes - i) // 2
        state[f"t{i // chunk:05d}"] = torch.ones(n, dtype=torch.bfloat16, device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    snap = host_copy(state)
    snapshot_s = time.perf_counter() - t0
    del state
    store = CheckpointStore(str(folder / "state"))
    t0 = time.perf_counter()
    store.save(1, lambda f: torch.save(snap, f / "learner.pt"), keep=1)
    write_s = time.perf_counter() - t0
    return {"bytes": nbytes, "device": device, "snapshot_seconds": snapshot_s,
            "write_seconds": write_s}  # fmt: skip


def machine_rates(folder: Path, size: int = 256 << 20) -> dict[str, float]:
    """This machine's sha256 (one core) and write+fsync rates, bytes/s."""
    data = os.urandom(size)
    t0 = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    sha = size / (time.perf_counter() - t0)
    path = folder / "rate.bin"
    t0 = time.perf_counter()
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    write = size / (time.perf_counter() - t0)
    path.unlink()
    return {"sha256": sha, "write_fsync": write}


def showo_prediction(rates: dict[str, float], fixed_s: float) -> dict[str, Any]:
    from dataclasses import asdict, replace

    from maskgrpo_ray.planner.checkpoint_cost import CheckpointRates, checkpoint_bytes
    from maskgrpo_ray.planner.cost_model import SHOWO_PARAMS

    nbytes = checkpoint_bytes(SHOWO_PARAMS, SHOWO_PARAMS, bf16=True)
    stated = replace(CheckpointRates(), fixed_s=fixed_s)
    here = replace(
        stated,
        sha256=rates["sha256"],
        learner_write=rates["write_fsync"],
        driver_write=rates["write_fsync"],
    )
    return {
        "bytes": nbytes,
        "seconds_stated_rates": stated.seconds(nbytes),
        "seconds_this_machines_disk_and_hash": here.seconds(nbytes),
        "stated_rates": asdict(stated),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    ap.add_argument("--state-gb", type=float, default=None, help="default: Show-o 512's")
    ap.add_argument("--device", default="cpu", help="where the large state lives (cpu, cuda)")
    ap.add_argument("--only-state", action="store_true", help="only the large state's timing")
    ap.add_argument("--dir", default=str(ROOT), help="the folder the checkpoints are written in")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.pop("RAY_ADDRESS", None)
    from maskgrpo_ray.planner.checkpoint_cost import checkpoint_bytes
    from maskgrpo_ray.planner.cost_model import SHOWO_PARAMS

    gb = args.state_gb or checkpoint_bytes(SHOWO_PARAMS, SHOWO_PARAMS, bf16=True) / 1e9
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        state = measure_state(Path(tmp), gb, args.device)
        print(
            f"state of {state['bytes'] / 1e9:.2f} GB on {state['device']}: snapshot "
            f"{state['snapshot_seconds']:.2f} s (the step loop's), whole write "
            f"{state['write_seconds']:.2f} s (the background writer's)",
            flush=True,
        )
        if args.only_state:
            if args.out:
                Path(args.out).write_text(json.dumps({"state": state}, indent=1) + "\n")
            return 0
        runs = [measure_run(b, Path(tmp) / b, args.steps, args.every) for b in ("ray", "local")]
        async_toy = measure_async_toy(Path(tmp) / "async", args.steps, args.every)
        rates = machine_rates(Path(tmp))
    ray_run = runs[0]
    out = {
        "toy": runs,
        "toy_async": async_toy,
        "state": state,
        "machine": rates,
        "showo_512": showo_prediction(rates, ray_run["seconds_median"]),
    }
    print(
        f"toy, local, run.checkpoint_async: {async_toy['path_seconds_median']:.3f} s on the "
        f"step's path (median), {async_toy['write_seconds_median']:.3f} s in the background"
    )
    print("| backend | checkpoints | bytes | seconds (median / max) | step seconds (median) |")
    print("|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r['backend']} | {r['checkpoints']} | {r['bytes']:,} | "
            f"{r['seconds_median']:.3f} / {r['seconds_max']:.3f} | {r['step_seconds_median']:.3f} |"
        )
    sp = out["showo_512"]
    print(
        f"\nthis machine: sha256 {rates['sha256'] / 2**30:.2f} GiB/s, write+fsync "
        f"{rates['write_fsync'] / 2**30:.2f} GiB/s\nShow-o 512 (predicted): {sp['bytes'] / 1e9:.2f} "
        f"GB, {sp['seconds_stated_rates']:.0f} s at the stated rates, "
        f"{sp['seconds_this_machines_disk_and_hash']:.0f} s with this machine's disk and hash"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
