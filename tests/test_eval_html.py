"""``report.html`` and the Ray dashboard in a real headless browser (Debian's chromium driven by
Playwright): the report loads without console errors, every image renders, the table cells hold
report.json's numbers; a toy Ray run's ``maskgrpo_*`` metrics are listed where the dashboard's
metrics view reads them.

Skips only when no chromium binary is installed (``apt-get install -y chromium``; ``make``'s
set-up installs it when run as root). Playwright's own browser download is not used.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_runs import NO_GRIDS, RAY_SHARES, tiny_toy

from maskgrpo_ray.cli import main

ROOT = Path(__file__).resolve().parent.parent
TOY = str(ROOT / "configs" / "toy.yaml")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
INSTALL_HINT = "no chromium binary; install it with `apt-get install -y chromium` (Debian)"
SMALL_EVAL = [
    "eval.samples_per_prompt=2",
    "eval.prompts_per_unit=8",
    "rollout.unmasking_steps=4",
    "logging.progress_bar=false",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip(INSTALL_HINT)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        yield b
        b.close()


def _page_with_error_log(browser: Any) -> tuple[Any, list[str]]:
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    return page, errors


# ----------------------------------------------------------------------------- report.html


def _fake_run_dir(tmp_path: Path) -> Path:
    """A finished run as ``maskgrpo eval`` reads one: config.yaml, final_policy.safetensors
    (the base weights, perturbed, so base and tuned differ) and a metrics.jsonl with reward and
    evaluation rows (so the report draws both curves)."""
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.evaluation.weights import save_final_policy
    from maskgrpo_ray.pipeline.build import build_policy

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(TOY, run / "config.yaml")
    torch.manual_seed(1)
    policy = build_policy(load_config(TOY, SMALL_EVAL).model)
    state = {n: p.detach() + 0.5 * torch.randn_like(p) for n, p in policy.named_parameters()}
    save_final_policy(run, state, {"step": 3})
    rows = [
        {"step": s, "reward_mean": 0.1 * s, "accuracy": 0.05 * s, "eval_reward": 0.2 + 0.1 * s}
        for s in range(4)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


@pytest.fixture(scope="module")
def eval_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("eval_html")
    run = _fake_run_dir(tmp)
    out = tmp / "out"
    argv = ["eval", "--config", TOY, *sum((["--set", s] for s in SMALL_EVAL), [])]
    argv += ["--backend", "local", "--weights", "base", "--weights", str(run), "--out", str(out)]
    assert main(argv) == 0
    return out


def _at(report: dict[str, Any], path: list[Any]) -> Any:
    node: Any = report
    for key in path:
        node = node[key]
    return node


def test_report_html_is_self_contained(eval_out):
    text = (eval_out / "report.html").read_text()
    # no file, network or script reference: every src is a data URI, no link/script tags
    assert "<script" not in text and "<link" not in text and "url(" not in text
    srcs = text.count(' src="')
    assert srcs > 0 and srcs == text.count(' src="data:image/png;base64,')
    assert "http://" not in text and "https://" not in text


def test_report_html_renders_in_chromium_with_report_json_numbers(browser, eval_out):
    report = json.loads((eval_out / "report.json").read_text())
    labels = [m["label"] for m in report["models"]]
    assert labels == ["base", "tuned"]
    page, errors = _page_with_error_log(browser)
    page.goto((eval_out / "report.html").as_uri(), wait_until="load")
    assert errors == []
    assert page.title() == "Evaluation report"

    # every image decoded: naturalWidth > 0; one per plot the report drew, one per model grid
    widths = page.eval_on_selector_all("img", "els => els.map(e => [e.complete, e.naturalWidth])")
    assert widths and all(done and w > 0 for done, w in widths), widths
    plots = page.eval_on_selector_all("img.plot", "els => els.map(e => e.dataset.plot)")
    assert sorted(plots) == sorted(report["files"]) == ["eval_curves", "grid", "reward_curve"]
    grids = page.eval_on_selector_all(
        ".model-grid",
        "els => els.map(e => [e.dataset.model, e.querySelectorAll('img').length])",
    )
    # 8 prompts (the grid's default) x 2 models, each with its 2 samples side by side
    assert len(grids) == 2 * 8
    assert [m for m, _ in grids[:2]] == labels and all(n == 2 for _, n in grids)

    # the tables: each number cell's value is report.json's, shown as the report formats it
    cells = page.eval_on_selector_all(
        "td[data-path]",
        "els => els.map(e => [e.dataset.path, e.dataset.value ?? null, e.textContent])",
    )
    numbers = [(json.loads(p), v, t) for p, v, t in cells if v is not None]
    seen = {tuple(p[:1]) for p, _, _ in numbers}
    assert {("metrics",), ("differences",), ("per_tag",), ("models",)} <= seen
    for path, value, shown in numbers:
        expected = _at(report, path)
        assert math.isclose(float(value), expected, rel_tol=1e-9, abs_tol=0.0), path
        assert shown == (str(expected) if isinstance(expected, int) else f"{expected:.4f}"), path
    # and every figure of report.json's metric and tag tables has exactly one cell
    paths = [p for p, _, _ in numbers]
    for name in report["metrics"]:
        for label in labels:
            for key in ("mean", "n"):
                assert paths.count(["metrics", name, label, key]) == 1, (name, label, key)
    for name, per_tag in report["per_tag"].items():
        for tag in per_tag:
            for label in labels:
                if per_tag[tag][label]["mean"] is not None:
                    assert paths.count(["per_tag", name, tag, label, "mean"]) == 1
    page.close()


def test_user_strings_are_escaped(tmp_path):
    """A label and a prompt with markup come out as text, not as elements."""
    import numpy as np
    from PIL import Image

    from maskgrpo_ray.evaluation.report import build_report
    from maskgrpo_ray.evaluation.types import EvalSample, ModelEval

    evil = '<img src=x onerror="alert(1)">&'
    evals = []
    for label in ("base", "t<b>"):
        samples = []
        for p in range(2):
            path = f"m{len(evals)}_{p}.png"
            Image.fromarray(np.full((8, 8, 3), 50 * p, np.uint8)).save(tmp_path / path)
            samples.append(EvalSample(p, 0, f"{evil} {p}", "tag&", {"acc": float(p)}, path))
        evals.append(ModelEval(label, f"{label}.pt", samples, {}, {"images": 2}))
    build_report(tmp_path, evals, grid_prompts=2, grid_samples=1, bootstrap_resamples=50)
    text = (tmp_path / "report.html").read_text()
    assert evil not in text and "<b>" not in text
    assert html_escape(evil) in text and "t&lt;b&gt;" in text and "tag&amp;" in text
    # the only images: 1 grid figure + 2 prompts x 2 models x 1 sample, all data URIs
    assert text.count("<img ") == 1 + 4 == text.count('src="data:image/png;base64,')


def html_escape(s: str) -> str:
    import html

    return html.escape(s, quote=True)


# ----------------------------------------------------------------------------- Ray dashboard


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TRAIN_SMALL = tiny_toy(3, 4, "rollout.num_actors=1", NO_GRIDS, *RAY_SHARES)
EXPECTED = ("maskgrpo_steps_total", "maskgrpo_reward_mean", "maskgrpo_policy_version")


def _ray_auth_headers() -> dict[str, str]:
    """The HTTP header Ray's own clients send to the dashboard when token auth is on."""
    from ray._raylet import AuthenticationTokenLoader

    loader = AuthenticationTokenLoader.instance()
    return dict(loader.get_token_for_http_header()) if loader.has_token() else {}


def _metric_names(prometheus_text: str) -> set[str]:
    """The ``maskgrpo_*`` sample names of a Prometheus text page (``name{labels} value``);
    Ray exports an application's metrics with a ``ray_`` prefix, dropped here."""
    names = set()
    for line in prometheus_text.splitlines():
        name = line.split("{")[0].split(" ")[0].removeprefix("ray_")
        if name.startswith("maskgrpo_"):
            names.add(name)
    return names


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(600)
def test_dashboard_lists_the_runs_maskgrpo_metrics(browser, tmp_path, monkeypatch):
    import ray

    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():
        ray.shutdown()
    from maskgrpo_ray.cluster.attach import apply_env_defaults, force_loopback

    apply_env_defaults()
    force_loopback()
    dash, metrics_port = _free_port(), _free_port()
    ray.init(
        num_cpus=4,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dash,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        # the training run joins this head (connect() is idempotent) and leaves it up
        args = ["train", "--backend", "ray", "--run-dir", str(tmp_path / "run")]
        assert main(args + sum((["--set", s] for s in TRAIN_SMALL), [])) == 0
        # the dashboard's own client sends Ray's token (Ray's token auth is on by default)
        context = browser.new_context(extra_http_headers=_ray_auth_headers())
        page = context.new_page()
        base = f"http://127.0.0.1:{dash}"
        page.goto(f"{base}/#/metrics", wait_until="load")
        assert "Ray" in page.title()
        # the Prometheus targets the dashboard publishes for its metrics view (HTTP service
        # discovery), then each target's Prometheus text
        page.goto(f"{base}/api/prometheus/sd")
        groups = json.loads(page.inner_text("body"))
        targets = [t for g in groups for t in g["targets"]]
        assert f"127.0.0.1:{metrics_port}" in targets, targets
        found: set[str] = set()
        deadline = time.monotonic() + 60
        while True:
            for target in targets:
                page.goto(f"http://{target}/metrics")
                found |= _metric_names(page.inner_text("body"))
            if set(EXPECTED) <= found or time.monotonic() > deadline:
                break
            page.wait_for_timeout(1000)  # the next metrics report (every second here)
        assert set(EXPECTED) <= found, sorted(found)
        context.close()
    finally:
        ray.shutdown()
