"""LoRA adapters (peft) on the policy: ``model.lora``.

The adapted policy equals the base at the start (B = 0), only the adapter trains, the KL
reference is the same module with the adapter off, the first epoch's ratio is one and its loss
is the full-weight path's, the saved adapter is peft's format (``PeftModel.from_pretrained``
loads it), the merged weights load into a policy built without LoRA, and a LoRA run resumes
exactly and is evaluated from its adapter folder.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tiny_runs import NO_GRIDS, RAY_SHARES, TINY_BASE, crash_at_step, tiny_toy

from maskgrpo_ray.config import LoraConfig, load_config
from maskgrpo_ray.errors import UserError
from maskgrpo_ray.models.lora import (
    AdapterDisabled,
    apply_lora,
    from_peft_names,
    load_adapter,
    merged_state,
    save_adapter,
    to_peft_names,
)
from maskgrpo_ray.pipeline.learner_core import build_optimizer, reference_policy
from maskgrpo_ray.pipeline.learner_loss import accumulate_gradients
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.pipeline.phases import generate
from maskgrpo_ray.pipeline.settings import settings_from_config
from maskgrpo_ray.worlds.toy.model import ToyModelSpec, ToyPolicy

PROMPTS = ["one red dot on the left", "three blue dots on the top", "two cyan dots on the right"]
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["qkv", "proj", "head"])


def _base(seed: int = 0) -> ToyPolicy:
    torch.manual_seed(seed)
    return ToyPolicy(ToyModelSpec(grid=4, d_model=32, layers=2)).eval()


def _adapted(base: ToyPolicy, lora: LoraConfig = LORA) -> ToyPolicy:
    return apply_lora(copy.deepcopy(base), lora, "toy")


def _logits(policy, cond, x):  # noqa: ANN001, ANN202
    with torch.no_grad():
        return policy.conditioned(cond)(x)


def _inputs(policy):  # noqa: ANN001, ANN202
    cond = policy.tokenize(PROMPTS)
    x = torch.full((len(PROMPTS), policy.num_image_tokens), policy.codebook_size)
    x[:, ::3] = torch.arange(x[:, ::3].numel()).view(len(PROMPTS), -1) % policy.codebook_size
    return cond, x


def _perturb_adapter(policy, seed: int = 3) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_the_adapted_policy_starts_as_the_base_and_only_the_adapter_trains():
    base = _base()
    policy = _adapted(base)
    cond, x = _inputs(base)
    assert torch.equal(_logits(policy, cond, x), _logits(base, cond, x))
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained} == {"qkv", "proj", "head"}
    s = settings_from_config(load_config(None, [])).update
    held = {id(p) for g in build_optimizer(s, policy).param_groups for p in g["params"]}
    assert held == {id(p) for p in policy.parameters() if p.requires_grad}
    # the same adapter in every process: A is drawn from model.lora.init_seed
    torch.manual_seed(123)  # another process's RNG state
    again = _adapted(base)
    for (n, a), (_, b) in zip(policy.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n


def test_the_kl_reference_is_the_base_with_the_adapter_off():
    base = _base()
    policy = _adapted(base)
    _perturb_adapter(policy)
    cond, x = _inputs(base)
    assert not torch.allclose(_logits(policy, cond, x), _logits(base, cond, x))
    s = settings_from_config(load_config(None, ["train.kl_coef=0.1"])).update
    ref = reference_policy(s, policy)
    assert isinstance(ref, AdapterDisabled) and ref.policy is policy  # no second copy
    assert torch.equal(_logits(ref, cond, x), _logits(base, cond, x))
    assert not torch.allclose(_logits(policy, cond, x), _logits(base, cond, x))  # back on


def _batch(policy):  # noqa: ANN001, ANN202
    rb = generate(
        policy,
        PROMPTS,
        [0, 1, 2],
        group_size=4,
        num_steps=5,
        temperature=1.0,
        gumbel_temperature=1.0,
        guidance_scale=1.5,
        transition="p1",
        policy_version=0,
        generator=torch.Generator().manual_seed(0),
    )
    return TrainBatch.from_rollout(
        rb, torch.randn(rb.num_samples, generator=torch.Generator().manual_seed(1))
    )


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_first_epoch_ratio_is_one_and_the_loss_is_the_full_weight_paths(kl_coef):
    base = _base()
    batch = _batch(base)  # the behaviour policy: the base
    out = {}
    for name, policy in (("full", copy.deepcopy(base)), ("lora", _adapted(base))):
        s = settings_from_config(load_config(None, [f"train.kl_coef={kl_coef}"])).update
        ref = reference_policy(s, policy)
        policy.zero_grad(set_to_none=True)
        out[name] = accumulate_gradients(
            policy,
            batch,
            train_steps=torch.arange(5),
            micro_batch=7,
            clip_low=0.2,
            clip_high=0.2,
            kl_coef=kl_coef,
            ref_policy=ref,
        )
        grads = [p.grad for p in policy.parameters() if p.grad is not None]
        assert grads and any(float(g.abs().sum()) > 0 for g in grads)  # it learns
        if name == "lora":
            assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)
    full, lora = out["full"], out["lora"]
    print("full:", full, "\nlora:", lora)
    assert lora["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert full["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert lora["loss"] == pytest.approx(full["loss"], rel=1e-6, abs=1e-7)
    for k in [k for k in full if k.startswith("kl")]:
        assert lora[k] == pytest.approx(full[k], abs=1e-7), k


def test_the_saved_adapter_is_peft_format_and_merged_weights_load_in_the_base(tmp_path):
    from peft import PeftModel

    base = _base()
    policy = _adapted(base)
    _perturb_adapter(policy)
    cond, x = _inputs(base)
    want = _logits(policy, cond, x)
    state = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    assert from_peft_names(to_peft_names(state)).keys() == state.keys()
    folder = save_adapter(tmp_path / "adapter", state, LORA, base="toy")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(folder))
    torch.testing.assert_close(_logits(peft_model.base_model.model, cond, x), want)
    loaded, settings = load_adapter(folder)
    assert settings == {
        "rank": 4,
        "alpha": 8.0,
        # the adapted layers by full name: exact for any model
        "target_modules": [
            "blocks.0.proj",
            "blocks.0.qkv",
            "blocks.1.proj",
            "blocks.1.qkv",
            "head",
        ],
        "dropout": 0.0,
    }
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged_state(policy), strict=True)  # the base's own names
    torch.testing.assert_close(_logits(plain, cond, x), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(_logits(policy, cond, x), want)  # unmerged again


def test_target_modules_that_match_nothing_name_the_field():
    with pytest.raises(UserError, match=r"model\.lora\.target_modules=\['attn'\].*qkv"):
        _adapted(_base(), LoraConfig(target_modules=["attn"]))
    with pytest.raises(ValueError, match="model.lora.target_modules"):
        LoraConfig(target_modules=[])


SMALL = tiny_toy(
    6,
    3,
    "run.checkpoint_every_steps=2",
    "model.lora={rank: 4, alpha: 8, target_modules: [qkv, proj, head], save_merged: true}",
    "train.learning_rate=3e-3",
    warmup=False,
)


def _args(run, extra=()):  # noqa: ANN001, ANN202
    out = ["train", "--backend", "local", "--run-dir", str(run)]
    for s in [*SMALL, *extra]:
        out += ["--set", s]
    return out


def _rows(run):  # noqa: ANN001, ANN202
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_a_lora_run_resumes_exactly_and_evaluates_from_its_adapter(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from maskgrpo_ray.cli import main

    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(_args(full)) == 0
    with crash_at_step(monkeypatch, 5), pytest.raises(KeyboardInterrupt):
        main(_args(cut))
    assert (cut / "checkpoints" / "step_000004" / "adapter" / "adapter_config.json").is_file()
    assert main(["train", "--resume", str(cut)]) == 0
    a, b = _rows(full), _rows(cut)
    for step in range(6):
        for key in ("reward_mean", "loss", "ratio_mean", "grad_norm", "policy_version"):
            assert a[step].get(key) == pytest.approx(b[step].get(key), rel=1e-6, abs=1e-7)
    final_a = load_file(str(full / "final_policy.safetensors"))
    final_b = load_file(str(cut / "final_policy.safetensors"))
    assert final_a.keys() == final_b.keys() and all(".lora_" in k for k in final_a)
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)  # exact
    assert any(float(v.abs().max()) > 0 for k, v in final_a.items() if "lora_B" in k)  # trained
    merged = load_file(str(full / "final_policy_merged.safetensors"))
    assert not any(".lora_" in k or ".base_layer." in k for k in merged)
    # the adapter folder, evaluated on the base model's config (model.lora from its json),
    # gives the run's own final policy's figures
    from maskgrpo_ray.evaluation.cli import adapter_overrides
    from maskgrpo_ray.evaluation.weights import resolve_weights

    adapter = full / "final_adapter"
    extra = adapter_overrides([str(adapter)], None, [TINY_BASE])
    assert extra and "model.lora=" in extra[0]
    cfg = load_config(None, [TINY_BASE, *extra])
    state, desc = resolve_weights(str(adapter), cfg, tmp_path / "scratch")
    assert "LoRA adapter" in desc and state.keys() == final_a.keys()
    assert all(torch.equal(state[k], final_a[k]) for k in state)
    out = tmp_path / "eval"
    rc = main(
        ["eval", "--weights", f"run={full}", "--weights", f"adapter={adapter}"]
        + ["--set", "eval.samples_per_prompt=1", "--out", str(out), "--backend", "local"]
    )
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["means"]) == {"run", "adapter"}
    assert report["means"]["run"] == report["means"]["adapter"]


RAY_SMALL = tiny_toy(
    3,
    4,
    "rollout.num_actors=2",
    NO_GRIDS,
    *RAY_SHARES,
    "model.lora={rank: 4, alpha: 8, target_modules: [qkv, proj, head]}",
    "train.kl_coef=0.02",
)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sync", ["object_store", pytest.param("collective", marks=pytest.mark.ci)])
def test_a_ray_lora_run_syncs_the_adapter_only_and_equals_the_local_run(
    tmp_path, monkeypatch, sync
):
    """The Ray backend with LoRA (and KL against the adapter-disabled base): the weight sync
    moves the adapter's bytes only, by either sync; the trained adapter equals the single
    process's (float32 round-off of two optimizers), and the run exports it in peft's format."""
    from safetensors.torch import load_file

    from maskgrpo_ray.cli import main

    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    runs = {}
    for backend in ("local", "ray"):
        run = runs[backend] = tmp_path / backend
        args = ["train", "--backend", backend, "--run-dir", str(run)]
        for s in [*RAY_SMALL, f"learner.weight_sync={sync}"]:
            args += ["--set", s]
        assert main(args) == 0
    a, b = _rows(runs["local"]), _rows(runs["ray"])
    for step in range(3):
        assert a[step]["reward_mean"] == b[step]["reward_mean"], step
    wa = load_file(str(runs["local"] / "final_policy.safetensors"))
    wb = load_file(str(runs["ray"] / "final_policy.safetensors"))
    assert wa.keys() == wb.keys() and all(".lora_" in k for k in wa)
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst <= 1e-5, worst
    adapter_bytes = sum(v.numel() * v.element_size() for v in wb.values())
    from maskgrpo_ray.pipeline.build import build_policy

    full = build_policy(load_config(None, RAY_SMALL[:1]).model)  # the run's model, no LoRA
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    synced = {r["weight_sync_bytes"] for r in b.values()}
    print(f"{sync}: sync {synced} bytes per actor; adapter {adapter_bytes}, full {full_bytes}")
    assert synced == {float(adapter_bytes)}
    assert adapter_bytes < full_bytes
    assert (runs["ray"] / "final_adapter" / "adapter_model.safetensors").is_file()


def _real_kind(kind: str, tmp_path) -> tuple:  # noqa: ANN001
    """A tiny random Show-o or aMUSEd (the real classes) as a model config."""
    from maskgrpo_ray.config import ModelConfig

    if kind == "showo":
        return ModelConfig(kind="showo", showo={"tiny_random": True}), ["a cat", "two dogs"]
    from maskgrpo_ray.models.amused_loading import save_tiny_random_amused

    folder = save_tiny_random_amused(tmp_path / "amused")
    return ModelConfig(kind="amused", args={"path": str(folder)}), ["a cat", "two dogs"]


@pytest.mark.parametrize("kind", ["showo", "amused"])
def test_lora_on_the_real_model_kinds(kind, tmp_path):
    """Show-o and aMUSEd (tiny random, the real classes) with an adapter on every linear layer
    they train: equal to the base at the start, only adapter tensors train (none on aMUSEd's
    frozen text encoder and VQ model), and a gradient step on the adapter moves the logits."""
    from maskgrpo_ray.pipeline.build import build_policy

    mc, prompts = _real_kind(kind, tmp_path)
    torch.manual_seed(0)
    base = build_policy(mc).eval()
    lora_mc = mc.model_copy(update={"lora": LoraConfig(rank=2, alpha=4.0)})
    torch.manual_seed(0)
    policy = build_policy(lora_mc).eval()
    base_trains = {n for n, p in base.named_parameters() if p.requires_grad}
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    adapted = {n.split(".lora_")[0] for n in trained}
    assert all(f"{m}.weight" in base_trains for m in adapted), sorted(adapted)[:5]
    cond = base.tokenize(prompts)
    x = torch.full((len(prompts), base.num_image_tokens), base.codebook_size)
    want = _logits(base, cond, x)
    torch.testing.assert_close(_logits(policy, cond, x), want, rtol=0, atol=0)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):  # B moves first (A's gradient is zero while B is), then A
        opt.zero_grad()
        policy.conditioned(cond)(x).logsumexp(-1).sum().backward()
        opt.step()
    moved = (_logits(policy, cond, x) - want).abs().max()
    assert torch.isfinite(moved) and float(moved) > 1e-6, moved
    print(
        kind,
        len(trained),
        "adapter tensors,",
        sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "trained parameters",
    )


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(600)
def test_a_bad_target_on_the_ray_backend_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Only a built model knows its layer names: the actors find the mistake, keep it, and
    raise it from ``ready``; the driver ends in its one line (exit 2), not Ray's traceback."""
    from maskgrpo_ray.cli import main

    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = ["train", "--backend", "ray", "--run-dir", str(tmp_path / "run")]
    for s in [*RAY_SMALL[:-2], "model.lora={target_modules: [attn]}"]:
        args += ["--set", s]
    assert main(args) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("maskgrpo: ")]
    assert len(err) == 1 and "model.lora.target_modules=['attn']" in err[0], err
    assert "qkv" in err[0] and "Traceback" not in err[0]
