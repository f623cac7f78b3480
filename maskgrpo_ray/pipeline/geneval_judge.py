"""The held-out GenEval judge of a run: which detector scores the reward, which the evaluation.

With the ``geneval`` reward, the in-run ``eval_accuracy`` is GenEval's correctness from
``eval.geneval``'s scorer (its defaults when the field is unset: ``detector: official``,
GenEval's own weights), not from the reward's: a policy that learns a detector's quirks is then
judged by another detector. A config whose two detectors are the same gets one warning at start
(:func:`warn_same_detector`); ``summary.json``'s ``geneval_detectors`` says which scored what.
"""

from __future__ import annotations

import logging
from typing import Any

from maskgrpo_ray.config import Config
from maskgrpo_ray.config.metrics import GenEvalJudgeConfig
from maskgrpo_ray.rewards.base import RewardSpec

log = logging.getLogger(__name__)

JUDGE_NAME = "geneval_judge"


def judge_spec(cfg: Config, specs: tuple[RewardSpec, ...]) -> RewardSpec | None:
    """The evaluation's GenEval scorer: ``eval.geneval``'s when set, its defaults when the
    reward has a ``geneval`` component and it is unset; None otherwise."""
    judge = cfg.eval.geneval
    if judge is None and any(s.kind == "geneval" for s in specs):
        judge = GenEvalJudgeConfig()
    if judge is None:
        return None
    return RewardSpec("geneval", 0.0, judge.reward_args(), name=JUDGE_NAME)


def _reward_detectors(specs: tuple[RewardSpec, ...]) -> dict[str, str]:
    from maskgrpo_ray.rewards.geneval import DEFAULT_DETECTOR

    return {
        s.name or s.kind: str(s.kwargs.get("detector", DEFAULT_DETECTOR))
        for s in specs
        if s.kind == "geneval"
    }


def geneval_detectors(specs: tuple[RewardSpec, ...], judge: RewardSpec | None) -> dict[str, Any]:
    """``{"reward/<component>": detector, ..., "eval_accuracy": detector}`` (empty: no GenEval
    scorer in the run)."""
    out: dict[str, Any] = {f"reward/{k}": v for k, v in _reward_detectors(specs).items()}
    if judge is not None:
        out["eval_accuracy"] = str(judge.kwargs["detector"])
    return out


def warn_same_detector(specs: tuple[RewardSpec, ...], judge: RewardSpec | None) -> bool:
    """One warning line when the evaluation's GenEval detector is one the reward trains with
    (compared as resolved: ``official`` and paths by folder, hub ids as written); True then."""
    from maskgrpo_ray.rewards.geneval_convert import detector_identity

    if judge is None:
        return False
    theirs = str(judge.kwargs["detector"])
    same = [
        name
        for name, d in _reward_detectors(specs).items()
        if detector_identity(d) == detector_identity(theirs)
    ]
    if same:
        log.warning(
            "eval.geneval.detector %s is also the detector of the geneval reward %s: the run's "
            "eval_accuracy is judged by the detector the policy trains against; set "
            "eval.geneval.detector to another (official, GenEval's own weights, or "
            "hf://facebook/mask2former-swin-small-coco-instance, Meta's Detectron2 training)",
            theirs,
            same[0],
        )
    return bool(same)
