"""An exponential moving average of the policy's trained tensors (``train.ema_decay``).

Flow-GRPO keeps one (github.com/yifan123/flow_grpo, ``flow_grpo/ema.py``'s ``EMAModuleWrapper``,
decay 0.9 in ``scripts/train_sd3.py``) and evaluates and saves it, while rollouts keep the live
policy. After the n-th optimizer step (n = 1, 2, ...; Flow-GRPO's ``global_step`` is counted
before its ``ema.step``) every shadow tensor moves towards the live one:

    d_n = min(d, (1 + n) / (10 + n))            (Flow-GRPO's ``get_current_decay``)
    ema <- d_n * ema + (1 - d_n) * theta

The warm-up term debiases the start: with a constant d the first updates would keep mostly the
base weights (d_1 = 2/11, d_8 = 1/2; it reaches d = 0.9 at n = 80).

The shadow is float32 whatever the parameters' dtype (a bf16 shadow would drop increments of
``(1 - d) x`` a small difference), on the parameters' device. :meth:`ParameterEma.applied` puts
it into the module and gives the live tensors back bit for bit (their copies, not a reverse
update).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)

WARMUP_OFFSET = 10.0  # the 10 of (1 + n) / (10 + n)


def ema_decay_at(decay: float, n: int) -> float:
    """The decay of the n-th update (n >= 1): ``min(decay, (1 + n) / (10 + n))``."""
    return min(decay, (1.0 + n) / (WARMUP_OFFSET + n))


def trained_named(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's trained parameters (``requires_grad``; LoRA: the adapter's), by name."""
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


@contextlib.contextmanager
def swapped_in(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block the module's parameters named in ``state`` hold its values (cast to each
    parameter's dtype and device); after it, exactly the values they had before."""
    params = dict(module.named_parameters())
    unknown = sorted(set(state) - set(params))
    if unknown:
        raise KeyError(f"weights for unknown parameters: {unknown[:5]}")
    live = {n: params[n].detach().clone() for n in state}
    try:
        with torch.no_grad():
            for n, v in state.items():
                params[n].copy_(v)
        yield
    finally:
        with torch.no_grad():
            for n, v in live.items():
                params[n].copy_(v)


class ParameterEma:
    """The float32 shadow of a module's trained tensors and the count of its updates.

    Args:
        module: the policy; the shadow starts from its trained tensors now.
        decay: d, 0 < d < 1 (``train.ema_decay``).
    """

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ParameterEma: decay {decay} must be in (0, 1)")
        self.decay = decay
        self.updates = 0
        self.shadow = {n: p.detach().float().clone() for n, p in trained_named(module).items()}

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> dict[str, float]:
        """One update after an optimizer step; returns ``ema/decay`` (d_n) and ``ema/distance``
        (the L2 norm of EMA - live over every trained tensor, after the update)."""
        self.updates += 1
        d = ema_decay_at(self.decay, self.updates)
        sq = 0.0
        for n, p in self._params(module).items():
            s = self.shadow[n]
            s.add_(p.detach().float() - s, alpha=1.0 - d)  # ema + (1 - d)(theta - ema)
            sq += float((s - p.detach().float()).double().square().sum())
        return {"ema/decay": d, "ema/distance": math.sqrt(sq)}

    def applied(self, module: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """A block in which the module holds the EMA (:func:`swapped_in`)."""
        return swapped_in(module, self.shadow)

    def weights(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The EMA on the CPU in each parameter's dtype: what a policy export or a rollout
        actor's evaluation takes (the form of the live ``trained_state``)."""
        params = self._params(module)
        return {n: s.to(device="cpu", dtype=params[n].dtype) for n, s in self.shadow.items()}

    def state_dict(self) -> dict[str, Any]:
        """The shadow (on the CPU), the update count and the decay: what a checkpoint keeps."""
        shadow = {n: s.detach().cpu().clone() for n, s in self.shadow.items()}
        return {"decay": self.decay, "updates": self.updates, "shadow": shadow}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (bit for bit; the decay stays the config's)."""
        shadow = state["shadow"]
        if set(shadow) != set(self.shadow):
            extra, missing = set(shadow) - set(self.shadow), set(self.shadow) - set(shadow)
            raise ValueError(
                f"EMA state: its tensors differ from the policy's trained ones (extra "
                f"{sorted(extra)[:3]}, missing {sorted(missing)[:3]}): was it saved with "
                "another model or LoRA setting?"
            )
        for n, s in self.shadow.items():
            s.copy_(shadow[n])
        self.updates = int(state["updates"])

    def resume(self, module: torch.nn.Module, state: Mapping[str, Any] | None, where: str) -> None:
        """After ``module`` was loaded from the checkpoint ``where``: its EMA ``state``, or,
        for a checkpoint saved without one (``train.ema_decay`` 0), a new EMA from the loaded
        weights, announced."""
        if state is not None:
            self.load_state_dict(state)
            return
        log.warning(
            "%s holds no EMA (saved with train.ema_decay 0?): the EMA (train.ema_decay=%s) "
            "starts again from the loaded weights, with its warm-up",
            where,
            self.decay,
        )
        self.shadow = {n: p.detach().float().clone() for n, p in trained_named(module).items()}
        self.updates = 0

    def _params(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        params = trained_named(module)
        if set(params) != set(self.shadow):
            raise ValueError("ParameterEma: the module's trained tensors changed since the start")
        return params
