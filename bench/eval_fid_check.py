"""Our FID/KID (``maskgrpo_ray.evaluation.fid.FidKid``) against torch-fidelity's own
``calculate_metrics`` on the same two folders of images, and the seconds each took.

    python bench/eval_fid_check.py RUN_DIR/eval/base/images RUN_DIR/eval/tuned/images \
        --weights /models/weights-inception-2015-12-05-6726825d.pth

Without ``--weights`` a random-weights Inception file is made (no download): the figures then
only show that the two computations agree, not image quality. Folders are searched deeply
(GenEval's layout nests the samples).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    import torch_fidelity

    from maskgrpo_ray.config.metrics import MetricSpec
    from maskgrpo_ray.evaluation.fid import FidKid
    from maskgrpo_ray.evaluation.metric_files import image_files
    from maskgrpo_ray.evaluation.tiny import random_inception_file

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("generated")
    ap.add_argument("reference")
    ap.add_argument("--weights", default=None)
    ap.add_argument("--kid-subset-size", type=int, default=100)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        weights = args.weights or random_inception_file(Path(tmp) / "inception.pth")
        n_gen = len(image_files(Path(args.generated)))
        n_ref = len(image_files(Path(args.reference)))
        subset = min(args.kid_subset_size, n_gen, n_ref)
        spec = MetricSpec(
            kind="fid", weights=weights, reference_dir=args.reference, kid_subset_size=subset
        )
        t0 = time.perf_counter()
        ours = FidKid(spec)(Path(args.generated))
        t_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        theirs = torch_fidelity.calculate_metrics(
            input1=args.generated,
            input2=args.reference,
            fid=True,
            kid=True,
            kid_subset_size=subset,
            samples_find_deep=True,
            feature_extractor_weights_path=weights,
            cuda=torch.cuda.is_available(),
            verbose=False,
            save_cpu_ram=True,
        )
        t_theirs = time.perf_counter() - t0
    print(f"images: generated {n_gen}, reference {n_ref}; weights: {args.weights or 'random'}")
    rows = [
        ("fid", ours["fid"], theirs["frechet_inception_distance"]),
        ("kid_mean", ours["kid_mean"], theirs["kernel_inception_distance_mean"]),
        ("kid_std", ours["kid_std"], theirs["kernel_inception_distance_std"]),
    ]
    print(f"{'figure':10} {'ours':>14} {'torch-fidelity':>16} {'ratio':>10}")
    for name, a, b in rows:
        print(f"{name:10} {a:14.6f} {b:16.6f} {a / b if b else float('nan'):10.6f}")
    print(f"seconds: ours {t_ours:.1f}, torch-fidelity {t_theirs:.1f}")


if __name__ == "__main__":
    main()
