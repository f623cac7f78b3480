"""The held-out evaluation: the prompts (with their GenEval tags), the executor's evaluation with
the world's diversity ceiling beside it, and the base model's evaluation (and its step-0 monitor
probe) kept on disk and reused (``eval.reuse_base_evaluation``).

Every recipe trained on one seed starts from the same base model and evaluates it with the same
fixed-seed sampler, so a batch of recipes evaluates the same model again and again. With the
field on, the first run writes its base evaluation to
``$MASKGRPO_CACHE_DIR/base_eval/<key>.json`` and later runs with the same key read it back. The
key hashes everything the evaluation depends on: the base weights the executor holds (every
trainable tensor's bytes, in name order: the pre-trained world or checkpoint, or a LoRA
adapter's initial weights; frozen weights behind a LoRA are named by the model section's path),
the model, data, rollout, reward and evaluation sections and ``run.seed``. The evaluation draws
from generators seeded by its own settings (``evaluation.generation``), never from the training
streams, so skipping it leaves what a run learns unchanged (a test compares the rows).

The monitors' probe of the base (step 0: the fixed probe set drawn twice, the base's
calibration; ``loop.monitoring``) is kept the same way, under a key that adds the monitors'
settings and the backend (``probe/kl`` is there where the backend holds the base).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from maskgrpo_ray.config import Config
from maskgrpo_ray.evaluation.generation import ceiling_figures
from maskgrpo_ray.loop.executor import Executor

log = logging.getLogger(__name__)

SECTIONS = ("model", "data", "rollout", "reward", "eval")
VERSION = 2  # bump when the evaluation's code changes what it reports


@dataclass(frozen=True)
class EvalSet:
    """Held-out prompts with their GenEval tags (one per prompt; None: untagged): evaluations
    then also report ``eval_<key>/<tag>``."""

    prompts: list[str]
    tags: list[str | None]

    def __len__(self) -> int:
        return len(self.prompts)


def evaluate_held_out(
    cfg: Config, ex: Executor, eval_prompts: list[str] | EvalSet
) -> dict[str, float]:
    """The executor's held-out evaluation and, beside it, the ceiling of its
    ``eval_diversity/distinct`` where the world knows it (``evaluation.generation``)."""
    if isinstance(eval_prompts, EvalSet):
        prompts, tags = eval_prompts.prompts, eval_prompts.tags
        out = ex.evaluate(prompts, tags)
    else:
        prompts, tags = eval_prompts, None
        out = ex.evaluate(prompts)
    out.update(ceiling_figures(cfg.model, prompts, cfg.eval.samples_per_prompt, tags))
    return out


def cache_dir() -> Path:
    """``$MASKGRPO_CACHE_DIR/base_eval`` (default ``~/.cache/maskgrpo-ray/base_eval``)."""
    root = Path(os.environ.get("MASKGRPO_CACHE_DIR", Path.home() / ".cache" / "maskgrpo-ray"))
    return root / "base_eval"


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class BaseDigest:
    """The base weights' :func:`weights_digest`, taken at most once a run: the held-out
    evaluation's key and the monitor probe's share it (hashing Show-o's 1.3B weights takes
    seconds, and on Ray ``state`` fetches them from the learner first)."""

    def __init__(self, state: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self._state = state
        self._digest: str | None = None

    def __call__(self) -> str:
        if self._digest is None:
            self._digest = weights_digest(self._state())
        return self._digest


def key_of(cfg: Config, digest: str, what: str = "eval") -> str:
    """The evaluation's key: the base weights' ``digest`` (:class:`BaseDigest`), the sections
    it depends on, the seed; for ``what="probe"`` (the monitors' step-0 probe) the monitors'
    settings and the backend too."""
    dumped = cfg.model_dump(mode="json")
    parts = {s: dumped[s] for s in SECTIONS}
    head: list = [VERSION, digest, cfg.run.seed, parts]
    if what == "probe":
        head += [what, dumped["logging"]["monitors"], cfg.run.backend]
    blob = json.dumps(head, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def evaluate_base(
    cfg: Config,
    digest: Callable[[], str],
    evaluate: Callable[[], dict[str, float]],
    what: str = "eval",
) -> tuple[dict[str, float], bool]:
    """``evaluate()``, or its kept result where ``eval.reuse_base_evaluation`` finds one (and
    the result kept for the next run), with whether it was read back (the run's summary says
    so: ``base_eval_reused``, ``probe_reused``). ``digest`` gives the base weights' digest (called only
    when the field is on: a run's :class:`BaseDigest`); ``what``: "eval" (the held-out evaluation) or "probe" (the monitors' probe of
    the base, :func:`key_of`)."""
    if not cfg.eval.reuse_base_evaluation:
        return evaluate(), False
    name = key_of(cfg, digest(), what)
    path = cache_dir() / (f"{name}.json" if what == "eval" else f"{what}-{name}.json")
    if path.exists():
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.warning("base evaluation %s unreadable (%s): evaluating again", path, e)
        else:
            said = {"eval": "held-out evaluation", "probe": "monitor probe"}[what]
            log.info("base model: %s reused from %s (eval.reuse_base_evaluation)", said, path)
            return {k: float(v) for k, v in found.items()}, True
    out = evaluate()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)  # atomic: two runs racing write the same figures
    return out, False
