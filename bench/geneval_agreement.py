"""How often does the in-process GenEval scorer decide as the official evaluator does, on the
same images? Reads the official evaluator's results file (djghosh13/geneval
``evaluation/evaluate_images.py --outfile``: one line per image with ``filename``, ``tag``,
``correct``, ``reason`` and the image's ``metadata``), judges the same images in-process with
each ``--detector`` (default ``official``: GenEval's own weights after ``maskgrpo geneval
convert-detector``) and prints, per tag and overall, the share of images whose 0/1 decision
agrees, each side's accuracy and the number that differ; ``--out`` also keeps every image that
differs with both reasons. Needs the real weights (the converted detector, open_clip's
ViT-L-14/openai in the Hugging Face cache) and, at GenEval's 553 x 4 images, a GPU.

    python -m bench.geneval_agreement --results results.jsonl --images OUT/base/images \\
        [--detector official --detector hf-folder] [--device cuda] [--out agreement.json]

docs/gpu.md ("GenEval: our scorer against the official evaluator") says how to make both files.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch


def read_results(path: Path, images: Path | None) -> list[dict[str, Any]]:
    """The evaluator's lines, each with ``path`` (its image, found as written or, when the
    evaluator ran elsewhere, as ``<prompt>/samples/<k>.png`` under ``images``) and ``meta``."""
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        meta = r["metadata"] if isinstance(r["metadata"], dict) else json.loads(r["metadata"])
        where = Path(r["filename"])
        if not where.is_file() and images is not None:
            where = images.joinpath(*where.parts[-3:])
        if not where.is_file():
            raise SystemExit(f"{r['filename']}: no such image (pass --images, the folder read)")
        rows.append({**r, "path": where, "meta": meta, "correct": bool(r["correct"])})
    return rows


def judge_all(rows: list[dict[str, Any]], detector: str, args: argparse.Namespace) -> list:
    """The in-process :class:`Judgement` of every row's image, batched by image size."""
    from PIL import Image

    from maskgrpo_ray.rewards.geneval import GenEvalScorer

    scorer = GenEvalScorer(
        detector,
        args.colour_model,
        None if args.colour_pretrained == "none" else args.colour_pretrained,
        device=args.device,
        batch_size=args.batch_size,
        detector_scale=args.detector_scale,
    )
    out: list[Any] = [None] * len(rows)
    by_size: dict[tuple[int, int], list[int]] = defaultdict(list)
    arrays = {}
    for i, r in enumerate(rows):
        arrays[i] = np.asarray(Image.open(r["path"]).convert("RGB"))
        by_size[arrays[i].shape[:2]].append(i)
    for idx in by_size.values():
        for s in range(0, len(idx), args.batch_size):
            part = idx[s : s + args.batch_size]
            images = torch.from_numpy(np.stack([arrays[i] for i in part]))
            for i, j in zip(part, scorer.judge(images, [rows[i]["meta"] for i in part])):
                out[i] = j
    return out


def table(rows: list[dict[str, Any]], ours: list[Any]) -> dict[str, dict[str, float]]:
    """Per tag and ``overall``: images, agreement share, official and in-process accuracy."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        groups[r["tag"]].append(i)
    groups["overall"] = list(range(len(rows)))
    out = {}
    for tag, idx in groups.items():
        same = [rows[i]["correct"] == ours[i].correct for i in idx]
        out[tag] = {
            "images": len(idx),
            "agreement": float(np.mean(same)),
            "differ": len(idx) - int(sum(same)),
            "official_accuracy": float(np.mean([rows[i]["correct"] for i in idx])),
            "ours_accuracy": float(np.mean([ours[i].correct for i in idx])),
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", type=Path, required=True, help="the evaluator's --outfile")
    ap.add_argument("--images", type=Path, default=None, help="the image folder it read")
    ap.add_argument("--detector", action="append", default=None, help="official (default), a "
                    "folder, or several --detector to compare")  # fmt: skip
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda if present)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--colour-model", default="ViT-L-14", help="GenEval's; tests: a tiny one")
    ap.add_argument("--colour-pretrained", default="openai", help="'none': no tag")
    ap.add_argument("--detector-scale", type=int, nargs=2, default=[1333, 800])
    ap.add_argument("--out", type=Path, default=None, help="JSON: tables and every difference")
    args = ap.parse_args(argv)
    rows = read_results(args.results, args.images)
    report: dict[str, Any] = {"results": str(args.results), "images": len(rows), "detectors": {}}
    for detector in args.detector or ["official"]:
        ours = judge_all(rows, detector, args)
        tab = table(rows, ours)
        print(f"\ndetector {detector}: {len(rows)} images")
        print(f"{'tag':<16}{'images':>8}{'agree':>9}{'differ':>8}{'official':>10}{'ours':>8}")
        for tag, t in tab.items():
            print(
                f"{tag:<16}{t['images']:>8}{t['agreement']:>9.3f}{t['differ']:>8}"
                f"{t['official_accuracy']:>10.3f}{t['ours_accuracy']:>8.3f}"
            )
        diffs = [
            {"filename": r["filename"], "tag": r["tag"], "official": r["correct"],
             "official_reason": r["reason"], "ours": j.correct, "ours_reason": j.reason}
            for r, j in zip(rows, ours) if r["correct"] != j.correct
        ]  # fmt: skip
        report["detectors"][detector] = {"per_tag": tab, "differences": diffs}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
