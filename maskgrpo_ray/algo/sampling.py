"""Show-o's unmasking, made recordable (showlab/Show-o ``models/modeling_showo.py``
``t2i_generate`` and ``models/sampling.py`` ``mask_by_random_topk``).

One step at state ``Y_t``: sample a token at every masked position from
``softmax(logits / temperature)``, score each by ``log p(x_i) + tau_t * Gumbel`` (``tau`` anneals
by compounding, ``tau <- tau * (1 - (t+1)/S)``), re-mask the ``m_t`` lowest and commit the rest.
Already-committed positions are never re-masked. The mask schedule (``m_t``) and the anneal are
arguments, Show-o's by default, so that a model can bring its own. The random draws happen in the reference's
order (one ``multinomial`` over ``[N*L, V]``, then one ``uniform_`` over ``[N, L]``), so with the
same generator and logits the sampler reproduces Show-o's ``t2i_generate`` exactly.

The trajectory is recorded compactly: ``unmask_step[n, i]`` is the step at which position ``i``
of sample ``n`` was committed (``-1`` if it was given). The state before step ``t`` is therefore
``final_tokens`` where ``unmask_step < t`` and masked elsewhere; :func:`replay_states` rebuilds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from maskgrpo_ray.algo.schedule import (
    GumbelAnneal,
    MaskSchedule,
    compounding_anneal,
    num_masked_after_step,
)
from maskgrpo_ray.algo.transition import step_log_prob

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # tokens [N, L] (mask = V) -> [N, L, V]


@dataclass(frozen=True)
class StepOutcome:
    """One unmasking step for ``N`` samples."""

    next_tokens: torch.Tensor  # [N, L] long, state Y_{t+1} (masked = V)
    sampled: torch.Tensor  # [N, L] long, sampled token at every position (known ones kept)
    masked: torch.Tensor  # [N, L] bool, masked before the step
    unmasked: torch.Tensor  # [N, L] bool, newly unmasked U_t
    tau: float  # Gumbel temperature used at this step


@dataclass(frozen=True)
class Trajectory:
    """A recorded rollout of ``N`` samples over ``S`` steps."""

    final_tokens: torch.Tensor  # [N, L] long, all positions filled
    unmask_step: torch.Tensor  # [N, L] long, step that committed each position (-1 = given)
    old_logp: torch.Tensor  # [N, S] float32, transition log-prob under the sampling policy
    sampled: torch.Tensor | None  # [N, S, L] long, sampled tokens per step (AR-style only)
    kind: str  # transition definition of old_logp: "p1" | "p2" | "ar"
    likelihood_tau: torch.Tensor  # [S] float32, Gumbel tau_t that old_logp integrates (0: Eq. 14)
    # [N, S, L] long, the sampler's token at every position per step (keep_predictions only)
    predictions: torch.Tensor | None = None
    masked_before: torch.Tensor | None = None  # [N, S] long, masked tokens before each step


def gumbel_noise(
    shape: tuple[int, ...],
    generator: torch.Generator | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``-log(-log(u))`` with ``u ~ U(0, 1)`` and Show-o's 1e-20 clamps, float32, on ``device``.

    The uniforms are drawn on ``device`` with ``generator`` (which must live there), as Show-o's
    ``gumbel_noise`` draws ``zeros_like(probs).uniform_`` on the probabilities' device.
    """
    u = torch.zeros(shape, dtype=torch.float32, device=device).uniform_(0, 1, generator=generator)
    return -torch.log((-torch.log(u.clamp(min=1e-20))).clamp(min=1e-20))


def check_generator_device(generator: torch.Generator | None, device: torch.device) -> None:
    """Raise a clear error when ``generator`` cannot drive draws on ``device``.

    PyTorch rejects a CUDA generator for a CPU tensor (and the reverse) deep inside
    ``multinomial``/``uniform_``; this names the fix instead.
    """
    if generator is None:
        return
    if torch.device(generator.device).type != torch.device(device).type:
        raise ValueError(
            f"the sampler's generator is on {generator.device} but the logits are on {device}: "
            "every random draw uses a generator on the tensor's own device; create it with "
            f"torch.Generator(device={str(device)!r})"
        )


def draw_tokens(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's first draw, shared by both samplers: ``x_i ~ softmax(logits / temperature)``.

    One ``multinomial`` over ``[N*L, V]`` (Show-o's order: before any other draw of the step).

    Args:
        logits: float ``[N, L, V]``; tokens: long ``[N, L]``, the state (masked = ``V``).
        temperature: sampling temperature; generator: on the logits' device.

    Returns:
        ``masked [N, L]`` bool (masked before the step), ``probs [N, L, V]`` float32 and
        ``sampled [N, L]`` long (the draw at masked positions, the known token elsewhere).
    """
    n, length, vocab = logits.shape
    check_generator_device(generator, logits.device)
    masked = tokens == vocab  # [N, L]
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [N, L, V]
    draws = torch.multinomial(probs.reshape(n * length, vocab), 1, generator=generator)
    sampled = torch.where(masked, draws.view(n, length), tokens)  # [N, L]
    return masked, probs, sampled


def unmask_step(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    step: int,
    num_steps: int,
    tau: float,
    *,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    mask_schedule: MaskSchedule = num_masked_after_step,
    gumbel_anneal: GumbelAnneal = compounding_anneal,
) -> StepOutcome:
    """Advance ``Y_t -> Y_{t+1}``.

    Args:
        logits: float ``[N, L, V]`` codebook logits at ``Y_t`` (guidance already mixed in).
        tokens: long ``[N, L]``, the state ``Y_t`` with masked positions equal to ``V``.
        step: ``t`` (0-based); ``num_steps``: ``S``.
        tau: the previous step's Gumbel temperature (``tau_0`` before step 0); this step uses
            ``gumbel_anneal(tau, t, S)`` (default Show-o's ``tau * (1 - (t+1)/S)``).
        temperature: sampling temperature applied to the logits.
        generator: torch generator on the logits' device for the multinomial and Gumbel draws.
        mask_schedule: ``m_t = mask_schedule(t, S, L, masked before)``, positions left masked
            (default Show-o's cosine schedule); at ``t = S - 1`` everything is committed.
        gumbel_anneal: ``(tau_{t-1}, t, S) -> tau_t`` (default Show-o's compounding anneal).
    """
    n, length, vocab = logits.shape
    masked, probs, sampled = draw_tokens(logits, tokens, temperature, generator)
    conf = probs.gather(-1, sampled.clamp(max=vocab - 1).unsqueeze(-1)).squeeze(-1)  # [N, L]
    conf = torch.where(masked, conf, torch.full_like(conf, torch.finfo(torch.float32).max))
    tau = gumbel_anneal(tau, step, num_steps)
    noise = gumbel_noise((n, length), generator, logits.device)
    score = torch.log(conf.clamp(min=1e-20)) + tau * noise  # [N, L]
    num_masked = masked.sum(-1)  # [N]
    counts = num_masked.tolist()
    m_of = {c: mask_schedule(step, num_steps, length, c) for c in set(counts)}  # rows share
    keep_masked = torch.tensor([m_of[c] for c in counts], device=logits.device)  # [N], m_t
    if step >= num_steps - 1:
        remask = torch.zeros_like(masked)
    else:
        cutoff = score.sort(dim=-1).values.gather(-1, keep_masked.unsqueeze(-1))  # [N, 1]
        remask = masked & (score < cutoff)
    unmasked = masked & ~remask
    next_tokens = torch.where(remask, torch.full_like(sampled, vocab), sampled)
    return StepOutcome(next_tokens, sampled, masked, unmasked, tau)


SAMPLERS: tuple[str, ...] = ("showo", "ancestral")


def masked_share_before_steps(
    num_steps: int, num_tokens: int, mask_schedule: MaskSchedule = num_masked_after_step
) -> list[float]:
    """``k_t``, the share of the ``L`` tokens masked before step ``t`` when starting fully
    masked under ``mask_schedule`` (``k_0 = 1``), for ``t = 0..S`` (``k_S = 0``)."""
    shares, masked = [1.0], num_tokens
    for t in range(num_steps):
        masked = mask_schedule(t, num_steps, num_tokens, masked)
        shares.append(masked / num_tokens)
    return shares


def ancestral_step(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    step: int,
    shares: list[float],
    *,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> StepOutcome:
    """One step of the ancestral ("emerge", MDLM-style) sampler that MaskGRPO on MMaDA uses.

    Every masked position draws ``x_i ~ softmax(logits / temperature)`` and commits it,
    independently of the others and of the policy, with probability ``(k_t - k_{t+1}) / k_t``
    (``k`` from :func:`masked_share_before_steps`; 1 at the last step). There is no confidence
    ranking and no Gumbel noise, so which positions commit does not depend on the weights and
    Eq. 15 (``p2``) is this transition's exact log-probability up to a constant.

    Args:
        logits: float ``[N, L, V]``; tokens: long ``[N, L]`` (masked = ``V``).
        step: ``t``; shares: ``k_0..k_S``; generator: on the logits' device.
    """
    n, length, vocab = logits.shape
    masked, _, sampled = draw_tokens(logits, tokens, temperature, generator)
    k_t, k_s = shares[step], shares[step + 1]
    p_commit = 1.0 if step >= len(shares) - 2 or k_t <= 0 else (k_t - k_s) / k_t
    u = torch.zeros((n, length), dtype=torch.float32, device=logits.device)
    u.uniform_(0, 1, generator=generator)
    unmasked = masked & (u < p_commit)
    next_tokens = torch.where(masked & ~unmasked, torch.full_like(sampled, vocab), sampled)
    return StepOutcome(next_tokens, sampled, masked, unmasked, 0.0)


def rollout(
    logits_fn: LogitsFn,
    initial_tokens: torch.Tensor,
    codebook_size: int,
    *,
    num_steps: int,
    temperature: float = 1.0,
    gumbel_temperature: float = 1.0,
    kind: str = "p1",
    remask_likelihood: str = "marginal",
    generator: torch.Generator | None = None,
    mask_schedule: MaskSchedule = num_masked_after_step,
    gumbel_anneal: GumbelAnneal = compounding_anneal,
    sampler: str = "showo",
    record_likelihood: bool = True,
    keep_predictions: bool = False,
) -> Trajectory:
    """Run ``S`` unmasking steps from ``initial_tokens`` and record the trajectory.

    Args:
        logits_fn: ``tokens [N, L] -> logits [N, L, V]`` with the condition (and guidance) bound.
        initial_tokens: long ``[N, L]``, usually all ``V`` (fully masked).
        codebook_size: ``V``.
        num_steps: ``S``; temperature: sampling temperature; gumbel_temperature: ``tau_0``.
        kind: transition definition cached as ``old_logp`` (see ``transition.step_log_prob``).
        remask_likelihood: ``"marginal"``: ``old_logp`` integrates the step's Gumbel remasking
            noise (its ``tau_t`` is recorded in ``likelihood_tau``); ``"eq14"``: Eq. 14 as
            printed, blind to the noise (``likelihood_tau`` all 0).
        generator: torch generator for reproducible draws.
        mask_schedule, gumbel_anneal: the model's schedules (see :func:`unmask_step`; Show-o's
            by default); ``likelihood_tau`` records the tau the anneal gave each step.
        sampler: ``"showo"`` (confidence ranking with Gumbel noise, :func:`unmask_step`) or
            ``"ancestral"`` (:func:`ancestral_step`; only ``p2`` is its exact likelihood).
        record_likelihood: False skips the per-step log-probs (``old_logp`` is ``[N, 0]``): a
            forward-estimator rollout scores the final sample instead.
        keep_predictions: also return ``predictions [N, S, L]`` and ``masked_before [N, S]``
            (the forward estimator's step focus reads them).

    Returns:
        The :class:`Trajectory`; ``old_logp[:, t]`` is the log-probability of step ``t`` under
        the logits that produced it, which the learner must reproduce before its first update.
    """
    if remask_likelihood not in ("marginal", "eq14"):
        raise ValueError(
            f"remask_likelihood must be 'marginal' or 'eq14', got {remask_likelihood!r}"
        )
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    tokens = initial_tokens.clone()
    step = _step_fn(
        sampler, num_steps, tokens.shape[1], temperature, generator, mask_schedule, gumbel_anneal
    )
    record = _Record(
        commit_step=torch.where(tokens == codebook_size, -2, -1).to(torch.long),
        kind=kind,
        codebook_size=codebook_size,
        temperature=temperature,
        marginal=remask_likelihood == "marginal",
        record_likelihood=record_likelihood,
        keep_predictions=keep_predictions,
    )
    tau = gumbel_temperature
    for t in range(num_steps):
        logits = logits_fn(tokens).float()  # [N, L, V]
        out = step(logits, tokens, t, tau)
        record.add(t, logits, out)
        tau, tokens = out.tau, out.next_tokens
    return record.trajectory(tokens)


StepFn = Callable[[torch.Tensor, torch.Tensor, int, float], StepOutcome]
"""``(logits [N, L, V], tokens [N, L], step t, tau_{t-1}) -> StepOutcome``, one sampler step."""


def _step_fn(
    sampler: str,
    num_steps: int,
    num_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
    mask_schedule: MaskSchedule,
    gumbel_anneal: GumbelAnneal,
) -> StepFn:
    """The step of ``sampler`` (:func:`unmask_step` or :func:`ancestral_step`) with the
    rollout's settings bound."""
    if sampler == "ancestral":
        shares = masked_share_before_steps(num_steps, num_tokens, mask_schedule)
        return lambda logits, tokens, t, tau: ancestral_step(
            logits, tokens, t, shares, temperature=temperature, generator=generator
        )
    return lambda logits, tokens, t, tau: unmask_step(
        logits,
        tokens,
        t,
        num_steps,
        tau,
        temperature=temperature,
        generator=generator,
        mask_schedule=mask_schedule,
        gumbel_anneal=gumbel_anneal,
    )


@dataclass
class _Record:
    """What :func:`rollout` keeps of each step, stacked into a :class:`Trajectory` at the end."""

    commit_step: torch.Tensor  # [N, L] long, each position's commit step (-1 given, -2 not yet)
    kind: str  # transition definition of old_logp
    codebook_size: int  # V, the mask value
    temperature: float
    marginal: bool  # old_logp integrates the Gumbel remasking noise (else Eq. 14, tau 0)
    record_likelihood: bool
    keep_predictions: bool
    old_logp: list[torch.Tensor] = field(default_factory=list)  # [N] per step
    sampled: list[torch.Tensor] = field(default_factory=list)  # [N, L] per step (AR-style only)
    likelihood_tau: list[float] = field(default_factory=list)
    predictions: list[torch.Tensor] = field(default_factory=list)  # [N, L] per step
    masked_before: list[torch.Tensor] = field(default_factory=list)  # [N] per step

    def add(self, t: int, logits: torch.Tensor, out: StepOutcome) -> None:
        """Record step ``t``, taken from ``logits [N, L, V]`` (before the temperature)."""
        self.likelihood_tau.append(out.tau if self.marginal else 0.0)
        if self.keep_predictions:
            self.predictions.append(out.sampled)
            self.masked_before.append(out.masked.sum(-1))
        if self.record_likelihood:
            self.old_logp.append(
                step_log_prob(
                    logits / self.temperature,
                    out.masked,
                    out.unmasked,
                    out.sampled,
                    self.kind,
                    gumbel_tau=self.likelihood_tau[-1],
                )
            )
        if self.kind == "ar" and self.record_likelihood:
            self.sampled.append(torch.where(out.masked, out.sampled, self.codebook_size))
        self.commit_step = torch.where(out.unmasked, t, self.commit_step)

    def trajectory(self, final_tokens: torch.Tensor) -> Trajectory:
        """The recorded rollout ending at ``final_tokens [N, L]`` (every position committed)."""
        if bool((self.commit_step == -2).any()):
            raise RuntimeError("rollout ended with masked positions; the last step must commit all")
        recorded = self.record_likelihood and self.kind == "ar"
        keep = self.keep_predictions
        return Trajectory(
            final_tokens=final_tokens,
            unmask_step=self.commit_step,
            old_logp=(
                torch.stack(self.old_logp, dim=1).float()
                if self.record_likelihood
                else torch.zeros(final_tokens.shape[0], 0, device=final_tokens.device)
            ),
            sampled=torch.stack(self.sampled, dim=1) if recorded else None,
            kind=self.kind,
            likelihood_tau=torch.tensor(
                self.likelihood_tau if self.record_likelihood else [], dtype=torch.float32
            ),
            predictions=torch.stack(self.predictions, dim=1) if keep else None,
            masked_before=torch.stack(self.masked_before, dim=1) if keep else None,
        )


def replay_states(
    final_tokens: torch.Tensor,
    unmask_step: torch.Tensor,
    steps: torch.Tensor,
    codebook_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rebuild (state, masked, newly unmasked) for (sample, step) pairs from the record.

    Args:
        final_tokens: long ``[M, L]`` final tokens of each pair's sample.
        unmask_step: long ``[M, L]`` the sample's commit step per position.
        steps: long ``[M]`` the step ``t`` of each pair.
        codebook_size: ``V`` (the mask value).

    Returns:
        ``tokens [M, L]`` (``Y_t``, masked = V), ``masked [M, L]`` and ``unmasked [M, L]`` bool.
    """
    t = steps.view(-1, 1)
    masked = unmask_step >= t  # [M, L]
    unmasked = unmask_step == t
    tokens = torch.where(masked, torch.full_like(final_tokens, codebook_size), final_tokens)
    return tokens, masked, unmasked
