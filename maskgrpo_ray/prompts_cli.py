"""``maskgrpo prompts make`` (a GenEval-style or toy prompts file) and ``maskgrpo prompts check``
(what a prompts file holds after loading: counts, drops, tags)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    """Add the ``prompts`` command to the ``maskgrpo`` sub-parsers."""
    p = sub.add_parser("prompts", help="make or check prompt files")
    ps = p.add_subparsers(dest="prompts_command", required=True)
    m = ps.add_parser("make", help="write a GenEval-style (or toy) prompts file with metadata")
    m.add_argument("--kind", choices=["geneval", "toy"], default="geneval")
    m.add_argument("--n", type=int, default=1000, help="prompts to make (geneval)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--tags", default=None, help="comma-separated GenEval tags (default: all)")
    m.add_argument(
        "--exclude",
        default=None,
        metavar="FILE",
        help="prompts never to emit: the evaluation set (any format --prompts reads)",
    )
    m.add_argument("--split", choices=["train", "eval"], default="train", help="toy split")
    m.add_argument("--out", required=True, metavar="FILE", help=".jsonl, .json or .txt")
    c = ps.add_parser("check", help="load a prompts file and print what it holds")
    c.add_argument("file")
    c.add_argument("--prompt-column", default=None)
    c.add_argument("--require-tag", action="store_true", help="every line needs a GenEval tag")


def write_prompts(path: Path, metas: list[dict[str, Any]]) -> None:
    """``.jsonl`` one metadata object a line (GenEval's format), ``.json`` a list of them,
    ``.txt`` the prompt texts only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(m) + "\n" for m in metas))
    elif path.suffix == ".json":
        path.write_text(json.dumps(metas, indent=1) + "\n")
    elif path.suffix == ".txt":
        path.write_text("".join(m["prompt"] + "\n" for m in metas))
    else:
        raise ValueError(f"--out {path}: use a .jsonl, .json or .txt file")


def make(args: argparse.Namespace) -> int:
    from maskgrpo_ray.data import load_prompt_records
    from maskgrpo_ray.prompt_gen import make_geneval_prompts, toy_prompt_metadata

    if args.kind == "toy":
        metas = toy_prompt_metadata(args.split)
    else:
        excluded: list[str] = []
        if args.exclude:
            excluded = load_prompt_records(args.exclude, "eval").texts
        tags = args.tags.split(",") if args.tags else None
        metas = make_geneval_prompts(args.n, seed=args.seed, tags=tags, exclude_prompts=excluded)
    write_prompts(Path(args.out), metas)
    counts = Counter(m["tag"] for m in metas)
    print(f"wrote {len(metas)} prompts to {args.out}: {dict(sorted(counts.items()))}")
    return 0


def check(args: argparse.Namespace) -> int:
    from maskgrpo_ray.data import load_prompt_records

    loaded = load_prompt_records(
        args.file, "eval", column=args.prompt_column, require_tag=args.require_tag
    )
    tags = Counter((r.meta or {}).get("tag") for r in loaded.records)
    print(
        json.dumps(
            {
                "file": args.file,
                "prompts": len(loaded.records),
                "dropped": loaded.dropped,
                "tags": {str(k): v for k, v in sorted(tags.items(), key=lambda kv: str(kv[0]))},
            },
            indent=2,
        )
    )
    return 0


def run(args: argparse.Namespace) -> int:
    """0 done, 2 bad input (the message names the file, the field and the fix)."""
    try:
        return make(args) if args.prompts_command == "make" else check(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"maskgrpo: {err}", file=sys.stderr)
        return 2
