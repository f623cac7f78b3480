"""``maskgrpo prompts make`` (a GenEval-style prompts file, or a named prompt set's split such as
the toy grammar's) and ``maskgrpo prompts check`` (what a prompts file holds after loading:
counts, drops, tags)."""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from maskgrpo_ray.prompts.loading import PromptRecord


def register(sub: Any) -> None:
    """Add the ``prompts`` command to the ``maskgrpo`` sub-parsers."""
    from maskgrpo_ray.models.registry import prompt_set_names

    p = sub.add_parser("prompts", help="make or check prompt files")
    ps = p.add_subparsers(dest="prompts_command", required=True)
    m = ps.add_parser("make", help="write a GenEval-style (or toy) prompts file with metadata")
    m.add_argument(
        "--kind",
        choices=["geneval", *prompt_set_names()],
        default="geneval",
        help="geneval: GenEval-style templates; a prompt set's name (toy): that set's --split",
    )
    m.add_argument(
        "--n",
        type=int,
        default=None,
        help="prompts to make (geneval, default 1000); a prompt set (toy): that many of the "
        "split, drawn with --seed (default: all)",
    )
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--tags", default=None, help="comma-separated GenEval tags (default: all)")
    m.add_argument(
        "--exclude",
        default=None,
        metavar="FILE",
        help="prompts never to emit: the evaluation set (any format --prompts reads)",
    )
    m.add_argument(
        "--prompt-column", default=None, help="the text column or key of the --exclude file"
    )
    m.add_argument(
        "--split", choices=["train", "eval"], default="train", help="split of a prompt set (toy)"
    )
    m.add_argument("--out", required=True, metavar="FILE", help=".jsonl, .json or .txt")
    c = ps.add_parser("check", help="load a prompts file and print what it holds")
    c.add_argument("file")
    c.add_argument("--prompt-column", default=None)
    c.add_argument("--require-tag", action="store_true", help="every line needs a GenEval tag")
    c.add_argument(
        "--split", choices=["train", "eval"], default="eval", help="split of a prompt set (toy)"
    )


OUT_FORMATS = (".jsonl", ".json", ".txt")


def _check_out(path: Path) -> None:
    if path.suffix not in OUT_FORMATS:
        raise ValueError(f"--out {path}: use a {', '.join(OUT_FORMATS)} file")


def write_prompts(path: Path, metas: list[dict[str, Any]]) -> None:
    """``.jsonl`` one metadata object a line (GenEval's format), ``.json`` a list of them,
    ``.txt`` the prompt texts only."""
    _check_out(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(m) + "\n" for m in metas))
    elif path.suffix == ".json":
        path.write_text(json.dumps(metas, indent=1) + "\n")
    else:
        path.write_text("".join(m["prompt"] + "\n" for m in metas))


def _subset(metas: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--n`` of a prompt set's split: that many, drawn with ``--seed``, in the split's order;
    ValueError (one line) when the split has fewer."""
    if args.n is None:
        return metas
    if not 1 <= args.n <= len(metas):
        raise ValueError(
            f"--n {args.n}: the {args.kind} set's {args.split} split has {len(metas)} prompts; "
            f"give --n from 1 to {len(metas)}, or leave it out for all of them"
        )
    keep = sorted(random.Random(args.seed).sample(range(len(metas)), args.n))
    return [metas[i] for i in keep]


def make(args: argparse.Namespace) -> int:
    from maskgrpo_ray.prompts.generate import make_geneval_prompts, prompt_set_metadata
    from maskgrpo_ray.prompts.loading import load_prompt_records

    _check_out(Path(args.out))
    if args.kind != "geneval":
        if args.exclude or args.tags:
            raise ValueError(
                f"--kind {args.kind} writes a split of that prompt set as it is; --exclude and "
                "--tags are for --kind geneval (a set's splits are disjoint already)"
            )
        metas = _subset(prompt_set_metadata(args.kind, args.split), args)
    else:
        held: list[PromptRecord] = []
        if args.exclude:
            held = load_prompt_records(args.exclude, "eval", column=args.prompt_column).records
        metas = make_geneval_prompts(
            1000 if args.n is None else args.n,
            seed=args.seed,
            tags=[t.strip() for t in args.tags.split(",") if t.strip()] if args.tags else None,
            exclude_prompts=[r.text for r in held],
            exclude_metadata=[r.meta for r in held if r.meta and "tag" in r.meta],
        )
    write_prompts(Path(args.out), metas)
    counts = Counter(m.get("tag") for m in metas)
    print(f"wrote {len(metas)} prompts to {args.out}: {dict(sorted(counts.items()))}")
    return 0


def check(args: argparse.Namespace) -> int:
    from maskgrpo_ray.prompts.loading import load_prompt_records

    loaded = load_prompt_records(
        args.file, args.split, column=args.prompt_column, require_tag=args.require_tag
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
    """``maskgrpo prompts make|check``: 0 done, 2 bad input, printed as ``maskgrpo: <message>``
    on stderr (the message names the file, the field and the fix)."""
    try:
        return make(args) if args.prompts_command == "make" else check(args)
    except (ValueError, OSError) as err:
        print(f"maskgrpo: {err}", file=sys.stderr)
        return 2
