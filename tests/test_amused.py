"""aMUSEd (``model.kind: amused``) against diffusers' own ``AmusedPipeline`` and
``AmusedScheduler``, on a tiny random folder of the real classes written to a temporary folder.

Equality is exact: the same seed gives the same tokens, the same images and (step by step) the
same logits as the pipeline; the recorded log-probabilities are checked against the
scheduler's sampling law by Monte Carlo (its own ``step``, many draws from one state).
"""

from __future__ import annotations

import json
import math
import shutil
from itertools import combinations, product

import numpy as np
import pytest
import torch

from maskgrpo_ray.algo.transition import step_log_prob
from maskgrpo_ray.config import ConfigError, load_config
from maskgrpo_ray.models.amused import (
    AmusedMaskSchedule,
    AmusedModelConfig,
    AmusedPolicy,
    LinspaceAnneal,
    policy_from_settings,
)
from maskgrpo_ray.models.amused_loading import save_tiny_random_amused
from maskgrpo_ray.models.registry import check_model_files, get_model, model_kinds
from maskgrpo_ray.models.showo_loading import ModelFilesMissing
from maskgrpo_ray.pipeline.phases import generate

pytest.importorskip("diffusers")
from diffusers import AmusedScheduler  # noqa: E402
from diffusers.pipelines.deprecated.amused.pipeline_amused import AmusedPipeline  # noqa: E402

CONFIG = "configs/amused_256_clip.yaml"
TINY_CONFIG = "configs/amused_tiny_random.yaml"
PROMPT = "a red dot on the left"
V, GRID = 16, 4  # the tiny folder's codebook and grid (L = 16, 16x16 px images)
MASK = V + 1  # its mask token id (aMUSEd's vocab_size - 1), not V


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: tiny matmuls on a loaded 2-core machine run 10x faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_random_amused(tmp_path_factory.mktemp("amused") / "tiny", codebook_size=V)


@pytest.fixture(scope="module")
def policy(folder) -> AmusedPolicy:
    return policy_from_settings(AmusedModelConfig(path=str(folder)))


@pytest.fixture(scope="module")
def pipe(folder) -> AmusedPipeline:
    pipe = AmusedPipeline.from_pretrained(str(folder), use_safetensors=True, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------- registry and configs


def test_registry_lists_amused():
    assert "amused" in model_kinds()
    assert get_model("amused").config_section is AmusedModelConfig


@pytest.mark.parametrize("path", [CONFIG, TINY_CONFIG])
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.model.kind == "amused" and cfg.model.args["path"]


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model.args={path: x, resolution_px: -3}", "resolution_px"),
        ("model.args={path: x, guidance: 3}", "guidance"),
        ("model.args={resolution_px: 256}", "path"),
        ("model.args={path: x, dtype: float8}", "dtype"),
        ("rollout.guidance_scale=0.5", "rollout.guidance_scale=0.5"),
        ("eval.guidance_scale=0.25", "eval.guidance_scale=0.25"),
    ],
)
def test_bad_settings_fail_validation_naming_the_field(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(CONFIG, [override])


def test_missing_files_name_the_field_the_path_and_the_fix(folder, tmp_path):
    cfg = load_config(TINY_CONFIG, [f"model.args.path={tmp_path / 'nowhere'}"])
    with pytest.raises(
        ModelFilesMissing, match=r"model\.args\.path: .*nowhere.*Hugging Face cache.*download"
    ):
        check_model_files(cfg.model)
    copy = shutil.copytree(folder, tmp_path / "pickled")
    weights = copy / "vqvae" / "diffusion_pytorch_model.safetensors"
    weights.rename(weights.with_suffix(".bin"))  # only a pickle left: refused, never read
    cfg = load_config(TINY_CONFIG, [f"model.args.path={copy}"])
    with pytest.raises(ModelFilesMissing, match=r"model\.args\.path: .*vqvae has no .*safetensors"):
        check_model_files(cfg.model)
    with pytest.raises(ModelFilesMissing, match=r"never a pickled \.bin"):
        policy_from_settings(AmusedModelConfig(path=str(copy)))
    shutil.rmtree(copy / "tokenizer")
    with pytest.raises(ModelFilesMissing, match=r"tokenizer does not exist; point model\.args"):
        check_model_files(cfg.model)
    check_model_files(load_config(TINY_CONFIG, [f"model.args.path={folder}"]).model)


# ---------------------------------------------------------------- schedules


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_mask_schedule_is_the_schedulers_mask_len(kind):
    """Walk the scheduler's own chains at tau = 0 (no remasking noise: it remasks exactly
    ``mask_len`` positions, continuous random confidences have no ties) and compare the number
    left masked after each step with ours, from the same number masked before."""
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for length in (16, 256, 1024):
        for steps in (1, 2, 3, 5, 8, 12, 18, 50):
            sched = AmusedScheduler(mask_token_id=8, masking_schedule=kind)
            sched.set_timesteps(steps, (0, 0))
            sample = torch.full((1, length), 8)
            for t, timestep in enumerate(sched.timesteps):
                before = int((sample == 8).sum())
                logits = torch.randn(1, length, 8, generator=gen)
                sample = sched.step(logits, timestep, sample, generator=gen).prev_sample
                after = int((sample == 8).sum())
                assert AmusedMaskSchedule(kind)(t, steps, length, before) == after
                checked += 1
    assert checked == 3 * (1 + 2 + 3 + 5 + 8 + 12 + 18 + 50)


def test_anneal_is_the_schedulers_linspace():
    """tau_t from chaining ``LinspaceAnneal`` equals ``set_timesteps``' temperatures bit for bit
    (a float recurrence alone differs in the last bits for most (tau_0, S)); a chain entered
    without step 0 follows the same line to 1e-6."""
    for start, end in ((2, 0), (1.3, 0.01), (3.0, 0.5), (0.7, 0.0)):
        anneal = LinspaceAnneal(end)
        for steps in range(1, 61):
            sched = AmusedScheduler(mask_token_id=8)
            sched.set_timesteps(steps, (start, end))
            taus, tau = [], float(start)
            for t in range(steps):
                tau = anneal(tau, t, steps)
                taus.append(tau)
            assert taus == sched.temperatures.tolist()
            fresh = LinspaceAnneal(end)
            for t in range(1, steps):
                assert fresh(taus[t - 1] + 1e-7, t, steps) == pytest.approx(taus[t], abs=1e-6)


# ---------------------------------------------------------------- prompting


def test_prompting_is_the_pipelines(policy, pipe):
    ids = policy.tokenize([PROMPT, "two blue dots"])
    ref = pipe.tokenizer(
        [PROMPT, "two blue dots"],
        return_tensors="pt",
        padding="max_length",
        truncation=True,
        max_length=77,
    ).input_ids
    assert ids.dtype == torch.long and ids.shape == (2, 77) and torch.equal(ids, ref)
    assert torch.equal(
        policy.null_condition(3),
        pipe.tokenizer(
            [""] * 3, return_tensors="pt", padding="max_length", max_length=77
        ).input_ids,
    )
    pooled, hidden = policy.encode_prompts(ids[[1, 0, 1]])
    out = pipe.text_encoder(ref, return_dict=True, output_hidden_states=True)
    assert torch.equal(pooled, out.text_embeds[[1, 0, 1]])
    assert torch.equal(hidden, out.hidden_states[-2][[1, 0, 1]])
    assert policy.micro_conds == (16, 16, 0, 0, 6.0)  # [width, height, crop, crop, aesthetic]


# ---------------------------------------------------------------- equality with the pipeline


def _record_scheduler(pipe, monkeypatch) -> list[tuple[torch.Tensor, ...]]:
    """Record what the pipeline's scheduler sees each step: (logits, sample, prev_sample)."""
    seen: list[tuple[torch.Tensor, ...]] = []
    step = pipe.scheduler.step

    def recording(model_output, timestep, sample, **kw):
        out = step(model_output=model_output, timestep=timestep, sample=sample, **kw)
        seen.append((model_output.clone(), sample.clone(), out.prev_sample.clone()))
        return out

    monkeypatch.setattr(pipe.scheduler, "step", recording)
    return seen


@pytest.mark.parametrize(
    ("prompts", "group", "guidance", "steps", "seed"),
    [
        ([PROMPT], 3, 0.0, 4, 0),
        ([PROMPT], 3, 4.0, 6, 1),
        (["two blue dots", PROMPT], 1, 10.0, 12, 2),
        (["two blue dots", PROMPT], 1, 1.0, 5, 3),  # w <= 1: no guidance, as the pipeline
    ],
)
def test_rollout_equals_the_pipeline(
    policy, pipe, monkeypatch, prompts, group, guidance, steps, seed
):
    """Same seed, same scheduler settings (temperature (2, 0), cosine): our generate gives the
    pipeline's tokens and images, our logits at each of its states are its model output, and
    our recorded tau and old log-probs are the scheduler's temperatures and the p1 marginal of
    its own transitions."""
    seen = _record_scheduler(pipe, monkeypatch)
    out = pipe(
        prompts,
        num_images_per_prompt=group,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator().manual_seed(seed),
        output_type="pil",
    )
    images = np.stack([np.asarray(img) for img in out.images])  # uint8 [N, 16, 16, 3]
    rb = generate(
        policy,
        prompts,
        list(range(len(prompts))),
        group_size=group,
        num_steps=steps,
        temperature=1.0,
        gumbel_temperature=2.0,
        guidance_scale=guidance,
        transition="p1",
        policy_version=0,
        generator=torch.Generator().manual_seed(seed),
    )
    n = len(prompts) * group
    assert len(seen) == steps
    final = seen[-1][2].view(n, GRID * GRID)
    assert torch.equal(rb.final_tokens, final)
    assert rb.images.dtype == torch.uint8 and rb.images.shape == images.shape
    assert np.array_equal(rb.images.numpy(), images)
    assert rb.likelihood_tau.tolist() == pipe.scheduler.temperatures.tolist()
    bound = policy.conditioned(rb.cond_ids, guidance)
    for t, (logits, sample, after) in enumerate(seen):
        state = torch.where(sample == MASK, V, sample).view(n, -1)  # codebook space
        ref = logits.flatten(2).transpose(1, 2)  # [N, L, V]
        with torch.no_grad():
            assert torch.equal(bound(state), ref)
        masked = state == V
        unmasked = masked & (after.view(n, -1) != MASK)
        expect = step_log_prob(
            ref,
            masked,
            unmasked,
            after.view(n, -1),
            "p1",
            gumbel_tau=float(pipe.scheduler.temperatures[t]),
        )
        assert torch.equal(rb.old_logp[:, t], expect)
    assert rb.old_logp[:, -1].abs().max() > 0  # the last step commits the rest: not trivial


def test_images_are_the_pipelines_decode(policy, pipe):
    """11 images: two of our decode chunks (8 + 3) against the pipeline's one batch."""
    tokens = torch.randint(0, V, (11, GRID * GRID), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = pipe.vqvae.decode(
            tokens.view(11, GRID, GRID), force_not_quantize=True, shape=(11, GRID, GRID, 4)
        ).sample.clip(0, 1)
    ref = np.stack([np.asarray(img) for img in pipe.image_processor.postprocess(out, "pil")])
    ours = policy.decode_images(tokens)
    assert ours.dtype == torch.uint8 and ours.shape == (11, 16, 16, 3)
    assert np.array_equal(ours.numpy(), ref)
    assert len(np.unique(ref)) > 100  # not a flat image


# ---------------------------------------------------------------- the scheduler's law


def _outcome_key(committed: torch.Tensor) -> torch.Tensor:
    """``[R, M]`` token committed at each of the ``M`` masked positions (``V``: still masked)
    -> one integer per row (base ``V + 1`` digits)."""
    return (committed * (V + 1) ** torch.arange(committed.shape[1])).sum(-1)


def _all_outcomes(masked_pos: torch.Tensor, commits: int, length: int):
    """Every outcome of a step that commits ``commits`` of the masked positions:
    ``C(M, commits) V^commits`` rows of (key, unmasked ``[L]`` bool, tokens ``[L]`` long)."""
    rows = []
    for chosen in combinations(range(len(masked_pos)), commits):
        for toks in product(range(V), repeat=commits):
            digits = [V] * len(masked_pos)
            for i, tok in zip(chosen, toks, strict=True):
                digits[i] = tok
            rows.append(digits)
    committed = torch.tensor(rows)  # [K, M]
    tokens = torch.zeros(len(rows), length, dtype=torch.long)
    tokens[:, masked_pos] = committed.clamp(max=V - 1)
    unmasked = torch.zeros(len(rows), length, dtype=torch.bool)
    unmasked[:, masked_pos] = committed != V
    return _outcome_key(committed), unmasked, tokens


def _scheduler_counts(logits, state, steps, t, temps, draws, seed) -> dict[int, int]:
    """Run ``AmusedScheduler.step`` ``draws`` times from one state (in aMUSEd's ids, as rows
    of one batch); count each outcome key over the masked positions."""
    sched = AmusedScheduler(mask_token_id=MASK)
    sched.set_timesteps(steps, temps)
    gen = torch.Generator().manual_seed(seed)
    masked_pos = (state[0] == V).nonzero().flatten()
    sample = torch.where(state == V, MASK, state)  # [1, L] aMUSEd ids
    counts: dict[int, int] = {}
    chunk = 25_000
    for start in range(0, draws, chunk):
        m = min(chunk, draws - start)
        after = sched.step(
            logits.expand(m, -1, -1), sched.timesteps[t], sample.expand(m, -1), generator=gen
        ).prev_sample[:, masked_pos]  # [m, M]
        keys, num = torch.unique(
            _outcome_key(torch.where(after == MASK, V, after)), return_counts=True
        )
        for k, c in zip(keys.tolist(), num.tolist(), strict=True):
            counts[k] = counts.get(k, 0) + c
    return counts


@pytest.mark.parametrize(
    ("steps", "t", "temps", "commits"),
    [
        (4, 1, (2, 0), 1),  # tau_1 = 4/3, the pipeline's default anneal: commit 1 of 3
        (25, 23, (1.0, 1.0), 2),  # tau = 1; m_t = floor(16 cos(0.48 pi)) = 1: commit 2 of 3
        (4, 1, (0, 0), 1),  # tau = 0: deterministic remasking, Eq. 14 exact
    ],
)
def test_step_log_prob_is_the_schedulers_law(policy, steps, t, temps, commits):
    """From a fixed state with 3 of 16 positions masked (the tiny model's conditional
    logits), repeat the scheduler's step 200k times and compare each outcome's count with
    200k exp(our log-prob) (p1, the Gumbel marginal at the scheduler's tau): every outcome
    expected 100+ times within 5 binomial sigma, Pearson's chi^2 over them under
    dof + 5 sqrt(2 dof), and the law sums to 1 over all outcomes (to 1e-5). Eq. 14 (the
    marginal's tau -> 0 limit) fails the same test at tau > 0, so the test tells them apart.

    Measured: 44 / 194 / 23 outcomes tested, max |z| 2.0 / 2.8 / 1.9, chi^2 36 / 201 / 25;
    Eq. 14 at the two tau > 0 cases: max |z| 157 and 60. The laws sum to 1 within 1e-7."""
    draws, length = 200_000, GRID * GRID
    state = torch.randint(0, V, (1, length), generator=torch.Generator().manual_seed(7))
    state[0, torch.tensor([2, 7, 13])] = V
    with torch.no_grad():
        logits = policy.conditioned(policy.tokenize([PROMPT]))(state)  # [1, L, V]
    anneal, tau = LinspaceAnneal(temps[1]), float(temps[0])
    for s in range(t + 1):
        tau = anneal(tau, s, steps)
    sched = AmusedScheduler(mask_token_id=MASK)
    sched.set_timesteps(steps, temps)
    assert tau == float(sched.temperatures[t])
    masked_before = int((state == V).sum())
    assert masked_before - policy.mask_schedule(t, steps, length, masked_before) == commits
    counts = _scheduler_counts(logits, state, steps, t, temps, draws, seed=t)
    keys, unmasked, tokens = _all_outcomes((state[0] == V).nonzero().flatten(), commits, length)
    assert set(counts) <= set(keys.tolist())  # the scheduler commits exactly `commits`
    freq = torch.tensor([counts.get(k, 0) for k in keys.tolist()], dtype=torch.float64)
    k = len(keys)
    masked, many = (state == V).expand(k, -1), logits.expand(k, -1, -1)

    def fits(log_prob: torch.Tensor) -> bool:
        """Every outcome expected 100+ times within 5 binomial sigma, and Pearson's chi^2
        over them under dof + 5 sqrt(2 dof)."""
        p = log_prob.double().exp()
        tested = draws * p >= 100
        z = ((freq - draws * p) / (draws * p * (1 - p)).sqrt())[tested]
        chi2 = float((((freq - draws * p) ** 2) / (draws * p))[tested].sum())
        dof = int(tested.sum())
        return dof >= 20 and float(z.abs().max()) < 5.0 and chi2 < dof + 5 * math.sqrt(2 * dof)

    logp = step_log_prob(many, masked, unmasked, tokens, "p1", gumbel_tau=tau)  # [K]
    assert fits(logp)
    assert float(logp.double().exp().sum()) == pytest.approx(1.0, abs=1e-5)
    if tau > 0:
        assert not fits(step_log_prob(many, masked, unmasked, tokens, "p1"))


# ---------------------------------------------------------------- the whole system


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_random_amused_trains_on_the_ray_system(folder, tmp_path, monkeypatch):
    from maskgrpo_ray.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run = tmp_path / "run"
    code = main(
        [
            "train",
            "--config",
            TINY_CONFIG,
            "--run-dir",
            str(run),
            "--set",
            f"model.args.path={folder}",
            "--set",
            "logging.progress_bar=false",
        ]
    )
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["backend"] == "ray" and summary["policy_version"] == 2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["groups_trained"] > 0 and math.isfinite(r["loss"]) for r in rows)
    assert (run / "samples" / "step_000000.png").exists()
