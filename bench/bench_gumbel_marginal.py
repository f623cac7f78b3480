"""Cost and truncation error of the Gumbel-marginal step log-probability at Show-o 512 px.

Layout: ``L = 1024`` image tokens, ``V = 8192`` codes, ``S = 50`` steps, ``tau_0 = 1``. For each
chosen step ``t`` the state before it has Show-o's ``m_{t-1}`` masked positions (random ones),
the logits are random normal with a per-position scale in ``[1, 7]`` (so the largest
probabilities spread from near-uniform to near-certain), and the transition is drawn with
``sampling.unmask_step`` at ``tau_t = remask_taus(1.0, 50)[t]``. The script times Eq. 14
(``step_log_prob`` kind ``"p1"``) and ``gumbel_marginal_log_prob`` (all ``V`` tokens, and
``top_k``), forward without gradient (the rollout's ``old_logp``) and forward + backward (the
learner), in the same process, and prints a markdown table with the ratio to Eq. 14 and each
``top_k``'s ``|log P|`` difference from the untruncated value. Run:
``python -m bench.bench_gumbel_marginal [--rows 1] [--steps 0,5,12] [--top-k 64,256]
[--repeats 2]`` (times are the least of the repeats, after a warm-up call).
"""

from __future__ import annotations

import argparse
import time

import torch

from maskgrpo_ray.algo.gumbel import gumbel_marginal_log_prob, remask_taus
from maskgrpo_ray.algo.sampling import StepOutcome, unmask_step
from maskgrpo_ray.algo.schedule import num_masked_after_step
from maskgrpo_ray.algo.transition import step_log_prob

LENGTH, VOCAB, NUM_STEPS = 1024, 8192, 50


def make_step(rows: int, step: int, seed: int) -> tuple[torch.Tensor, StepOutcome]:
    """Logits ``[N, L, V]`` at a Show-o-shaped state before ``step`` and the sampled transition."""
    g = torch.Generator().manual_seed(seed)
    masked = LENGTH
    for s in range(step):
        masked = num_masked_after_step(s, NUM_STEPS, LENGTH, masked)
    scale = torch.rand(rows, LENGTH, 1, generator=g) * 6 + 1
    logits = torch.randn(rows, LENGTH, VOCAB, generator=g) * scale  # [N, L, V]
    tokens = torch.randint(0, VOCAB, (rows, LENGTH), generator=g)
    for n in range(rows):
        tokens[n, torch.randperm(LENGTH, generator=g)[:masked]] = VOCAB
    taus = remask_taus(1.0, NUM_STEPS)
    prev = taus[step - 1] if step > 0 else 1.0
    out = unmask_step(logits, tokens, step, NUM_STEPS, prev, generator=g)
    assert out.tau == taus[step]
    return logits, out


def timed(fn, backward: bool, repeats: int) -> tuple[float, torch.Tensor]:
    """Least seconds over ``repeats`` calls of ``fn()`` (with ``.sum().backward()`` when asked),
    after one untimed call (first-touch page faults of fresh buffers cost up to 1 s here)."""
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        if backward:
            value = fn()
            value.sum().backward()
        else:
            with torch.no_grad():
                value = fn()
        if i > 0:
            best = min(best, time.perf_counter() - start)
    return best, value.detach()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--steps", default="0,5,12")
    ap.add_argument("--top-k", default="64,256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    top_ks = [None] + [int(k) for k in args.top_k.split(",") if k]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, N = {args.rows} rows\n")
    print(
        "| t | tau_t | |U| | |R| | method | fwd s | fwd / Eq.14 | fwd+bwd s | fwd+bwd / Eq.14 "
        "| log P (row 0) | max |d log P| vs all-V |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for step in [int(s) for s in args.steps.split(",")]:
        logits, out = make_step(args.rows, step, args.seed + step)
        remasked = out.masked & ~out.unmasked
        shape = (
            f"| {step} | {out.tau:.3g} | {int(out.unmasked[0].sum())} | {int(remasked[0].sum())} "
        )
        leaf = logits.clone().requires_grad_(True)

        def eq14(leaf=leaf, out=out):
            return step_log_prob(leaf, out.masked, out.unmasked, out.sampled, "p1")

        base_f, p1 = timed(eq14, False, args.repeats)
        base_b, _ = timed(eq14, True, args.repeats)
        print(
            f"{shape}| Eq. 14 (p1) | {base_f:.3f} | 1 | {base_b:.3f} | 1 | {float(p1[0]):.4f} | |"
        )
        exact = None
        for k in top_ks:

            def marginal(leaf=leaf, out=out, k=k):
                logp = torch.log_softmax(leaf, -1)
                return gumbel_marginal_log_prob(
                    logp, out.masked, out.unmasked, out.sampled, out.tau, top_k=k
                )

            fwd, value = timed(marginal, False, args.repeats)
            bwd, _ = timed(marginal, True, args.repeats)
            assert leaf.grad is not None and bool(torch.isfinite(leaf.grad).all())
            if exact is None:
                exact, diff = value, ""
            else:
                diff = f"{float((value - exact).abs().max()):.1e}"
            name = "marginal, all V" if k is None else f"marginal, top_k={k}"
            print(
                f"{shape}| {name} | {fwd:.3f} | {fwd / base_f:.0f} | {bwd:.3f} | "
                f"{bwd / base_b:.0f} | {float(value[0]):.4f} | {diff} |"
            )


if __name__ == "__main__":
    main()
