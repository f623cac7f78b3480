"""Transition log-probabilities of one unmasking step (paper Section 3.2, Eq. 13-15).

All three definitions take the codebook logits at state ``Y_t`` under the parameters being
evaluated and work in log space throughout (``log_softmax`` / ``logsumexp``, never
``log(softmax)``).
"""

from __future__ import annotations

import torch

from maskgrpo_ray.algo.gumbel import gather_tokens, gumbel_marginal_log_prob

TRANSITION_KINDS: tuple[str, ...] = ("p1", "p2", "ar")
# log-probability floor for a remasked position whose Eq. 14 set is empty
LOG_EMPTY_FLOOR = -69.0  # ~ log(1e-30)
# Gumbel temperatures at or below this use Eq. 14 (the marginal's limit as tau -> 0)
MARGINAL_MIN_TAU = 1e-4


def step_log_prob(
    logits: torch.Tensor,
    masked: torch.Tensor,
    unmasked: torch.Tensor,
    tokens: torch.Tensor,
    kind: str,
    *,
    gumbel_tau: float | torch.Tensor = 0.0,
    pair_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probability of the transition ``Y_t -> Y_{t+1}`` for each sample.

    Args:
        logits: float ``[N, L, V]``, codebook logits at state ``Y_t`` (temperature applied);
            with ``pair_rows``, ``[R, L, V]``: rows that several transitions read.
        masked: bool ``[N, L]``, positions masked before the step.
        unmasked: bool ``[N, L]``, positions newly unmasked at the step (``U_t``, the paper's
            ``Y_t^CaM``); a subset of ``masked``.
        tokens: long ``[N, L]``, the committed token at each newly unmasked position; for
            ``"ar"`` the sampled token at every masked position. Other entries are ignored.
        kind: ``"p2"`` (Eq. 15): ``sum_{i in U_t} log p^i(y_i)``.
            ``"p1"`` (Eq. 14): ``p2 + sum_{j remasked} log sum_{k: p^j_k < theta} p^j_k`` with
            ``theta = min_{i in U_t} p^i(y_i)`` under these logits; the exact probability of the
            transition when the choose-and-move confidence is deterministic (``tau = 0``).
            ``"ar"`` (Eq. 13): ``sum_{i masked} log p^i(x_i)``, the AR-style baseline.
        gumbel_tau: float or float ``[N]``, the Gumbel temperature ``tau_t`` of the step's
            remasking noise (Show-o perturbs log-confidences by ``tau_t * Gumbel``). For ``"p1"``
            a row with ``tau_t > MARGINAL_MIN_TAU`` gets the exact transition probability with
            the noise integrated out (:func:`maskgrpo_ray.algo.gumbel.gumbel_marginal_log_prob`),
            whose limit as ``tau -> 0`` is Eq. 14; ``0`` (the default) is Eq. 14 exactly.
            ``"p2"`` and ``"ar"`` do not model the remasking and ignore it.
        pair_rows: long ``[N]``, the row of ``logits`` each transition reads (trajectory
            shrinkage: the steps of one block share their block's first state). The
            ``log_softmax`` runs once per row; each transition then reads its own tokens and
            remasked positions from its row (``[P, V]`` for the ``P`` remasked positions, never
            a copy of the whole ``[N, L, V]``). None: row ``n`` for transition ``n``.

    Returns:
        float ``[N]``. An empty committed or remasked set contributes 0.
    """
    if kind not in TRANSITION_KINDS:
        raise ValueError(f"kind must be one of {TRANSITION_KINDS}, got {kind!r}")
    n, length = masked.shape
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, L, V], once per row
    rows = pair_rows if pair_rows is not None else torch.arange(n, device=logp.device)
    tok_logp = gather_tokens(logp, rows, tokens)  # [N, L]
    if kind == "ar":
        return torch.where(masked, tok_logp, torch.zeros_like(tok_logp)).sum(-1)
    committed = torch.where(unmasked, tok_logp, torch.zeros_like(tok_logp)).sum(-1)  # [N]
    if kind == "p2":
        return committed
    # Eq. 14: threshold = smallest committed probability (log space), no gradient through the
    # set membership; the logsumexp over the members carries the gradient.
    inf = torch.finfo(logp.dtype).max
    log_theta = torch.where(unmasked, tok_logp, torch.full_like(tok_logp, inf)).amin(-1)  # [N]
    # the remasked positions, where the step has a committed token (empty U_t: theta
    # undefined, and the step keeps everything masked with probability 1)
    pair, pos = (masked & ~unmasked & unmasked.any(-1, keepdim=True)).nonzero(as_tuple=True)
    logp_r = logp[rows[pair], pos]  # [P, V]
    below = logp_r.detach() < log_theta.detach()[pair, None]  # [P, V]
    # A position with no entry below theta would make logsumexp -inf and its gradient NaN; give
    # it a finite stand-in and replace its value below.
    nonempty = below.any(-1)  # [P]
    below = below | ~nonempty[:, None]
    log_q = torch.logsumexp(logp_r.masked_fill(~below, float("-inf")), dim=-1)  # [P]
    # Eq. 14 gives probability 0 to a remasked position with nothing below theta (possible only
    # when the rollout's confidence had Gumbel noise, tau > 0): floor it at LOG_EMPTY_FLOOR.
    log_q = torch.where(nonempty, log_q, torch.full_like(log_q, LOG_EMPTY_FLOOR))
    eq14 = committed.index_add(0, pair, log_q)  # [N]
    tau = torch.as_tensor(gumbel_tau, dtype=torch.float32, device=logp.device).expand(len(eq14))
    noisy = (tau > MARGINAL_MIN_TAU).nonzero().squeeze(1)  # transitions with remasking noise
    if noisy.numel() == 0:
        return eq14
    marginal = gumbel_marginal_log_prob(
        logp, masked[noisy], unmasked[noisy], tokens[noisy], tau[noisy], pair_rows=rows[noisy]
    )
    return eq14.index_put((noisy,), marginal.to(eq14.dtype))
