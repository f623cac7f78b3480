"""``maskgrpo geneval convert-detector PATH.pth [OUT]``: GenEval's own detector (the
mmdetection checkpoint its ``download_models.sh`` fetches) converted into the transformers
folder the in-process scorer loads (:mod:`maskgrpo_ray.rewards.geneval_convert`).

    maskgrpo geneval convert-detector \\
        mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco_20220504_001756-743b7d99.pth
    # -> $MASKGRPO_CACHE_DIR/geneval/mask2former-swin-s-mmdet (detector: official)
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    """Add the ``geneval`` command to the ``maskgrpo`` sub-parsers."""
    p = sub.add_parser("geneval", help="GenEval's own detector for the in-process scorer")
    ps = p.add_subparsers(dest="geneval_command", required=True)
    c = ps.add_parser(
        "convert-detector",
        help="convert GenEval's mmdetection Mask2Former checkpoint into a transformers folder",
    )
    c.add_argument("checkpoint", help="mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco_*.pth")
    c.add_argument(
        "out",
        nargs="?",
        default=None,
        help="output folder (default: where `detector: official` looks, "
        "$MASKGRPO_CACHE_DIR/geneval/mask2former-swin-s-mmdet)",
    )


def run(args: argparse.Namespace) -> int:
    from maskgrpo_ray.rewards.geneval_convert import (
        OFFICIAL_FILE,
        convert_detector,
        official_folder,
    )

    out = args.out or str(official_folder())
    source = convert_detector(args.checkpoint, out)
    note = "" if source["file"] == OFFICIAL_FILE else f" (not named {OFFICIAL_FILE})"
    print(f"converted {source['file']}{note}, sha256 {source['sha256']}, into {out}")
    if args.out is None:
        print("eval.geneval.detector: official (the default) now finds it")
    else:
        print(f"use it as detector: {out}")
    return 0
