"""Deployment files: the cluster launcher config, the job runtime env, the submission helper,
the KubeRay RayJob and the Grafana dashboard, each checked against what reads it.

No cluster is started: the launcher config is validated with the schema Ray ships
(``ray/autoscaler/ray-schema.json``) and Ray's own ``prepare_config``/``validate_config``; the
dashboard's PromQL is checked against the metric names ``maskgrpo_ray/cluster/ray_metrics.py`` defines,
read from that file at test time.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "ray_cluster.yaml"
RUNTIME_ENV = ROOT / "deploy" / "runtime_env.yaml"
RUNTIME_ENV_INSTALLED = ROOT / "deploy" / "runtime_env_installed.yaml"
DOCKERFILE_WHEEL = ROOT / "deploy" / "Dockerfile.wheel"
SUBMIT = ROOT / "deploy" / "submit.sh"
RAYJOB = ROOT / "deploy" / "kuberay" / "rayjob.yaml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DASHBOARD = ROOT / "deploy" / "grafana" / "maskgrpo_dashboard.json"
RAY_METRICS = ROOT / "maskgrpo_ray" / "cluster" / "ray_metrics.py"
SHOWO_CONFIG = "configs/showo_512_clip.yaml"
INSTALL = [
    "pip install -q -r requirements.txt",
    "pip install -q --no-deps -r requirements-nodeps.txt",
    "pip install -q --no-deps -e .",
]


def _ray_pin() -> str:
    """The exact Ray version requirements.txt pins (``ray[default]==X``)."""
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        m = re.fullmatch(r"ray(\[[^\]]*\])?==(\S+)", line.split("#")[0].strip())
        if m:
            return m.group(2)
    raise AssertionError("requirements.txt has no exact ray pin")


def _load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


# --------------------------------------------------------------------------- cluster launcher


@pytest.fixture(scope="module")
def ray_schema() -> dict[str, Any]:
    import ray.autoscaler

    path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return _load_yaml(CLUSTER_YAML)


def test_cluster_yaml_valid_against_rays_schema(cluster, ray_schema):
    jsonschema.validate(cluster, ray_schema)


def test_cluster_yaml_passes_rays_own_prepare_and_validate(cluster):
    # What `ray up` runs before launching anything: fill the provider's defaults, validate.
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(cluster)))


def _set(tree: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(tree)
    node = out
    *head, last = dotted.split(".")
    for k in head:
        node = node[k]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return out


_DELETE = object()


@pytest.mark.parametrize(
    "dotted, value",
    [
        ("provider", _DELETE),  # required
        ("cluster_name", _DELETE),  # required
        ("max_worker", 4),  # misspelt top-level key (additionalProperties: false)
        ("available_node_types.rollout_gpu.min_workers", "two"),  # not an integer
        ("available_node_types.learner_gpu.resources", {"GPU": 0.5}),  # fractional resource
        ("available_node_types.rollout_gpu.node_config", _DELETE),  # required per node type
        ("setup_commands", "pip install -e ."),  # a string, not a list of commands
        ("docker.imag", "rayproject/ray:2.60.0-py311-gpu"),  # misspelt docker key
    ],
)
def test_broken_cluster_yaml_is_rejected(cluster, ray_schema, dotted, value):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(_set(cluster, dotted, value), ray_schema)


def test_cluster_has_gpu_worker_types_for_rollout_and_learner(cluster):
    types = cluster["available_node_types"]
    head = cluster["head_node_type"]
    assert head in types and types[head]["resources"].get("GPU", 0) == 0
    workers = {k: v for k, v in types.items() if k != head}
    assert {"rollout_gpu", "learner_gpu"} <= set(workers)
    for name, t in workers.items():
        assert t["resources"].get("GPU", 0) >= 1, f"{name} has no GPU"
        assert 0 <= t["min_workers"] <= t["max_workers"], name
    assert sum(t["max_workers"] for t in workers.values()) <= cluster["max_workers"]


def test_cluster_fits_the_showo_config(cluster):
    # showo_512_clip needs 8 learner GPUs packed on one node (a PACK placement group), and one
    # GPU per rollout actor plus the reward actors' GPU shares on the rollout nodes.
    from maskgrpo_ray.config import load_config

    cfg = load_config(ROOT / SHOWO_CONFIG)
    types = cluster["available_node_types"]
    learner = types["learner_gpu"]
    need_learner = cfg.learner.num_workers * cfg.learner.num_gpus_per_worker
    assert learner["resources"]["GPU"] >= need_learner and learner["min_workers"] >= 1
    rollout = types["rollout_gpu"]
    need = (
        cfg.rollout.num_actors * cfg.rollout.num_gpus_per_actor
        + cfg.reward.num_actors * cfg.reward.num_gpus_per_actor
    )
    assert rollout["resources"]["GPU"] * rollout["max_workers"] >= need
    assert rollout["resources"]["CPU"] >= cfg.rollout.num_cpus_per_actor


def _commands(cluster: dict[str, Any], key: str) -> str:
    return "\n".join(cluster[key])


def test_cluster_dashboard_on_loopback_and_token_auth_on(cluster):
    head = _commands(cluster, "head_start_ray_commands")
    assert "--dashboard-host=127.0.0.1" in head
    assert "0.0.0.0" not in yaml.safe_dump(cluster)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        cmds = _commands(cluster, key)
        assert "export RAY_AUTH_MODE=token" in cmds, key
        assert "disabled" not in cmds, key
        # Ray's worker ports start at 10002; the metrics port must stay below (8090 measured).
        port = int(re.search(r"--metrics-export-port=(\d+)", cmds).group(1))
        assert port < 10002
    assert cluster["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_cluster_installs_this_package_like_the_makefile(cluster):
    setup = " ".join(_commands(cluster, "setup_commands").split())
    positions = [setup.find(step) for step in INSTALL]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), setup
    assert cluster["file_mounts"]["~/maskgrpo-ray"] == "."
    assert cluster["docker"]["image"].startswith(f"rayproject/ray:{_ray_pin()}-")


# --------------------------------------------------------------------------- runtime env


def test_runtime_env_is_what_ray_accepts_and_ships_no_heavy_dirs(monkeypatch):
    from ray.runtime_env import RuntimeEnv

    env = _load_yaml(RUNTIME_ENV)
    monkeypatch.chdir(ROOT)  # working_dir "." is relative to where `ray job submit` runs
    RuntimeEnv(**env)  # raises on unknown fields, wrong types or a missing working_dir
    assert env["working_dir"] == "."
    assert "pip" not in env and "uv" not in env and "conda" not in env
    excludes = {e.strip("/") for e in env["excludes"]}
    assert {".venv", "runs", ".cache", ".git"} <= excludes
    assert all(isinstance(v, str) for v in env["env_vars"].values())
    assert env["env_vars"]["HF_HUB_OFFLINE"] == "1"


# --------------------------------------------------------------------------- submit.sh


def _submit(*args: str, env: dict[str, str], home: Path) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "HOME": str(home)}
    return subprocess.run(
        ["bash", str(SUBMIT), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=10,
        cwd="/",
    )


def test_submit_sh_syntax_and_documented_line():
    subprocess.run(["bash", "-n", str(SUBMIT)], check=True, timeout=10)
    text = SUBMIT.read_text()
    assert "ray job submit" in text and "--working-dir ." in text
    assert "--runtime-env deploy/runtime_env.yaml" in text
    assert not re.search(r"RAY_AUTH_MODE=disabled", text)


def test_submit_sh_builds_the_job_command_with_token_auth(tmp_path):
    out = _submit("--dry-run", env={"RAY_AUTH_TOKEN": "t0ken-not-printed"}, home=tmp_path)
    assert out.returncode == 0, out.stderr
    cmd = shlex.split(out.stdout)
    assert cmd[:3] == ["ray", "job", "submit"]
    assert cmd[cmd.index("--address") + 1] == "http://127.0.0.1:8265"
    assert cmd[cmd.index("--working-dir") + 1] == "."
    assert cmd[cmd.index("--runtime-env") + 1] == "deploy/runtime_env.yaml"
    sep = cmd.index("--")
    assert cmd[sep + 1 :] == ["maskgrpo", "train", "--config", SHOWO_CONFIG]
    assert "t0ken-not-printed" not in out.stdout + out.stderr


def test_submit_sh_passes_maskgrpo_args_and_reads_the_default_token_file(tmp_path):
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("abc\n")
    out = _submit(
        "--address", "http://127.0.0.1:9999", "--no-wait", "--dry-run", "--",
        "validate", "--config", "configs/toy.yaml",
        env={}, home=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    cmd = shlex.split(out.stdout)
    assert "--no-wait" in cmd and cmd[cmd.index("--address") + 1] == "http://127.0.0.1:9999"
    assert cmd[cmd.index("--") + 1 :] == ["maskgrpo", "validate", "--config", "configs/toy.yaml"]
    assert "auth_token" in out.stderr


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "no Ray auth token found"),
        ({"RAY_AUTH_TOKEN": "x", "RAY_AUTH_MODE": "disabled"}, "only with token authentication"),
        ({"RAY_AUTH_TOKEN_PATH": "/nonexistent/token"}, "missing or empty"),
    ],
)
def test_submit_sh_refuses_without_token_auth(tmp_path, env, message):
    out = _submit("--dry-run", env=env, home=tmp_path)
    assert out.returncode == 2 and message in out.stderr
    assert out.stdout == ""


# --------------------------------------------------------------------------- installed with pip


def test_submit_sh_installed_uploads_nothing_and_names_a_built_in_config(tmp_path):
    from maskgrpo_ray.config import builtin

    out = _submit("--installed", "--dry-run", env={"RAY_AUTH_TOKEN": "t"}, home=tmp_path)
    assert out.returncode == 0, out.stderr
    cmd = shlex.split(out.stdout)
    assert cmd[:3] == ["ray", "job", "submit"] and "--working-dir" not in cmd
    assert cmd[cmd.index("--runtime-env") + 1] == "deploy/runtime_env_installed.yaml"
    args = cmd[cmd.index("--") + 1 :]
    assert args == ["maskgrpo", "train", "--config", "showo_512_clip"]
    assert args[-1] in builtin.names()  # read from the nodes' installed package
    out = _submit(
        "--installed", "--dry-run", "--", "status", env={"RAY_AUTH_TOKEN": "t"}, home=tmp_path
    )
    assert shlex.split(out.stdout)[-2:] == ["maskgrpo", "status"]


def test_installed_runtime_env_ships_nothing_and_keeps_the_job_env_vars(monkeypatch, tmp_path):
    from ray.runtime_env import RuntimeEnv

    env = _load_yaml(RUNTIME_ENV_INSTALLED)
    monkeypatch.chdir(tmp_path)  # nothing in it is relative to a checkout
    RuntimeEnv(**env)
    assert set(env) == {"env_vars"}  # no working_dir, py_modules, pip, uv or conda
    assert env["env_vars"] == _load_yaml(RUNTIME_ENV)["env_vars"]


def test_the_wheel_image_installs_the_wheel_alone_at_the_tested_pins():
    import tomllib

    text = DOCKERFILE_WHEEL.read_text()
    assert (
        re.search(r"^FROM\s+(\S+)", text, re.M).group(1).startswith(f"rayproject/ray:{_ray_pin()}-")
    )
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    wheel = re.search(r"^ARG WHEEL=(\S+)$", text, re.M).group(1)
    assert wheel == f"maskgrpo_ray-{version}-py3-none-any.whl"
    run = " ".join(text.split("RUN ", 1)[1].split())
    assert "pip install --no-cache-dir -c /tmp/maskgrpo-pins/requirements.txt" in run
    assert "--no-deps -r /tmp/maskgrpo-pins/requirements-nodeps.txt" in run
    assert "-e ." not in text and "COPY . ." not in text.replace("--chown=ray:users ", "")
    ignore = [x for x in (ROOT / "deploy" / "Dockerfile.wheel.dockerignore").read_text().splitlines()
              if x and not x.startswith("#")]  # fmt: skip
    assert ignore == [
        "*",
        "!dist/maskgrpo_ray-*.whl",
        "!requirements.txt",
        "!requirements-nodeps.txt",
    ]


# --------------------------------------------------------------------------- KubeRay


@pytest.fixture(scope="module")
def rayjob() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(RAYJOB.read_text()) if d]
    assert len(docs) == 1
    return docs[0]


def _containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    return group["template"]["spec"]["containers"]


def test_rayjob_kind_entrypoint_and_lifecycle(rayjob):
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    spec = rayjob["spec"]
    assert spec["entrypoint"].startswith(f"maskgrpo train --config {SHOWO_CONFIG}")
    assert (ROOT / SHOWO_CONFIG).exists()
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["rayClusterSpec"]["rayVersion"] == _ray_pin()


def test_rayjob_every_group_has_an_image_and_gpu_workers(rayjob):
    cluster_spec = rayjob["spec"]["rayClusterSpec"]
    head = cluster_spec["headGroupSpec"]
    for c in _containers(head):
        assert c.get("image"), "head container has no image"
    groups = cluster_spec["workerGroupSpecs"]
    assert {g["groupName"] for g in groups} == {"rollout-gpu", "learner-gpu"}
    for g in groups:
        for c in _containers(g):
            assert c.get("image"), g["groupName"]
            res = c["resources"]
            gpus = int(res["limits"]["nvidia.com/gpu"])
            assert gpus >= 1, g["groupName"]
            assert int(res["requests"]["nvidia.com/gpu"]) == gpus, g["groupName"]
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]


def test_rayjob_fits_the_showo_config(rayjob):
    from maskgrpo_ray.config import load_config

    cfg = load_config(ROOT / SHOWO_CONFIG)
    groups = {g["groupName"]: g for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]}

    def gpus(name: str) -> int:
        return int(_containers(groups[name])[0]["resources"]["limits"]["nvidia.com/gpu"])

    # the learner's PACK placement group must fit in one pod
    assert gpus("learner-gpu") >= cfg.learner.num_workers * cfg.learner.num_gpus_per_worker
    need = (
        cfg.rollout.num_actors * cfg.rollout.num_gpus_per_actor
        + cfg.reward.num_actors * cfg.reward.num_gpus_per_actor
    )
    assert gpus("rollout-gpu") * groups["rollout-gpu"]["replicas"] >= need


def test_rayjob_dashboard_not_public_and_token_auth_on(rayjob):
    cluster_spec = rayjob["spec"]["rayClusterSpec"]
    head = cluster_spec["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert not head.get("enableIngress", False)
    assert cluster_spec["authOptions"]["mode"] == "token"
    groups = [head, *cluster_spec["workerGroupSpecs"]]
    env = [e for g in groups for c in _containers(g) for e in c.get("env", [])]
    assert not [e for e in env if e["name"] == "RAY_AUTH_MODE" and e.get("value") != "token"]


def test_rayjob_runtime_env_matches_deploy_runtime_env(rayjob):
    # One set of job env vars: the RayJob's copy must not drift from deploy/runtime_env.yaml.
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])
    # working_dir exists in the image (the submitter pod runs it), not here
    workdir = re.search(r"^WORKDIR\s+(\S+)", DOCKERFILE.read_text(), re.M).group(1)
    assert env.pop("working_dir") == workdir
    RuntimeEnv(**env)
    assert env["env_vars"] == _load_yaml(RUNTIME_ENV)["env_vars"]


def test_dockerfile_base_image_matches_the_ray_pin():
    base = re.search(r"^FROM\s+(\S+)", DOCKERFILE.read_text(), re.M).group(1)
    assert base.startswith(f"rayproject/ray:{_ray_pin()}-")


# --------------------------------------------------------------------------- Grafana


def defined_metrics(source: str) -> dict[str, str]:
    """``{name: kind}`` from the GAUGES / COUNTERS / HISTOGRAMS dicts of cluster/ray_metrics.py."""
    kinds = {"GAUGES": "gauge", "COUNTERS": "counter", "HISTOGRAMS": "histogram"}
    out: dict[str, str] = {}
    for node in ast.parse(source).body:
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        name = getattr(target, "id", None)
        if name in kinds and isinstance(node.value, ast.Dict):
            for key in node.value.keys:
                assert isinstance(key, ast.Constant) and isinstance(key.value, str)
                out[key.value] = kinds[name]
    return out


def exported_names(metrics: dict[str, str]) -> set[str]:
    """Prometheus series Ray exports for them: ``ray_`` prefix; histograms as _bucket/_sum/_count.

    Counters keep their name (ours already end in ``_total``; measured on Ray 2.60.0).
    """
    out = set()
    for name, kind in metrics.items():
        if kind == "histogram":
            out |= {f"ray_{name}_{s}" for s in ("bucket", "sum", "count")}
        else:
            out.add(f"ray_{name}")
    return out


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        q = var.get("query")
        exprs.append(q["query"] if isinstance(q, dict) else "")
    return exprs


def queried_metrics(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in re.findall(r"\bray_maskgrpo_[a-z0-9_]+", e)}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_every_dashboard_metric_exists_in_ray_metrics(dashboard):
    if not RAY_METRICS.exists():
        pytest.fail(f"{RAY_METRICS.relative_to(ROOT)} is missing: the dashboard has no source")
    defined = defined_metrics(RAY_METRICS.read_text())
    assert defined, "no GAUGES/COUNTERS/HISTOGRAMS dict found in cluster/ray_metrics.py"
    missing = queried_metrics(dashboard_queries(dashboard)) - exported_names(defined)
    assert not missing, (
        f"the dashboard queries metrics cluster/ray_metrics.py does not define: {missing}"
    )


def test_metric_check_catches_an_unknown_metric():
    defined = defined_metrics('GAUGES = {"maskgrpo_a": "x"}\nHISTOGRAMS = {"maskgrpo_h": ("", ())}')
    ok = ["ray_maskgrpo_a", "histogram_quantile(0.5, rate(ray_maskgrpo_h_bucket[1m]))"]
    assert queried_metrics(ok) <= exported_names(defined)
    bad = ["ray_maskgrpo_h", "ray_maskgrpo_b"]  # a histogram without suffix; an unknown name
    assert queried_metrics(bad) - exported_names(defined) == {"ray_maskgrpo_h", "ray_maskgrpo_b"}


def test_dashboard_uses_a_prometheus_datasource_variable(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in dashboard["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]


@pytest.mark.parametrize(
    "family, metrics",
    [
        ("reward mean", {"ray_maskgrpo_reward_mean"}),
        ("accuracy", {"ray_maskgrpo_accuracy"}),
        ("filter drop rate", {"ray_maskgrpo_filter_drop_rate"}),
        (
            "policy version and lag",
            {"ray_maskgrpo_policy_version", "ray_maskgrpo_policy_version_lag"},
        ),
        ("phase latency", {"ray_maskgrpo_phase_seconds_bucket"}),
        ("weight sync", {"ray_maskgrpo_weight_sync_seconds_bucket"}),
        ("images per second", {"ray_maskgrpo_images_per_second"}),
        (
            "queue depths",
            {
                "ray_maskgrpo_queue_pending_chunks",
                "ray_maskgrpo_queue_inflight_rollouts",
                "ray_maskgrpo_queue_inflight_rewards",
            },
        ),
    ],
)
def test_dashboard_has_a_panel_per_metric_family(dashboard, family, metrics):
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    hits = [p for p in panels if metrics <= queried_metrics([t["expr"] for t in p["targets"]])]
    assert len(hits) == 1, f"{family}: {len(hits)} panels query {sorted(metrics)}"


def test_latency_panels_are_histogram_quantiles(dashboard):
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            if "_bucket" in t["expr"]:
                assert t["expr"].startswith("histogram_quantile("), t["expr"]
                assert "sum by (le" in t["expr"], t["expr"]


def test_the_head_start_leaves_the_token_file_owner_only(tmp_path):
    """``deploy/start_head.sh`` with a stand-in ``ray`` that, like ``ray start --head``, writes
    the token file world-readable: the script leaves it at 0600, starts the head on loopback
    with token auth, and ray_cluster.yaml's head does the same after its ``ray start``."""
    import stat

    home, log = tmp_path / "home", tmp_path / "calls.log"
    fake = tmp_path / "ray"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$RAY_AUTH_MODE $RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER $*" >> {log}\n'
        'mkdir -p "$HOME/.ray"; (umask 022; echo tok > "$HOME/.ray/auth_token"); '
        'chmod 644 "$HOME/.ray/auth_token"\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "HOME": str(home), "RAY_BIN": str(fake)}
    out = subprocess.run(
        ["bash", str(ROOT / "deploy" / "start_head.sh"), "--num-cpus=2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    mode = stat.S_IMODE((home / ".ray" / "auth_token").stat().st_mode)
    assert mode == 0o600, oct(mode)
    calls = log.read_text().splitlines()
    start = next(c for c in calls if " start --head" in c)
    assert start.startswith("token 0 ") and "--node-ip-address=127.0.0.1" in start
    assert "--dashboard-host=127.0.0.1" in start and "--num-cpus=2" in start
    head = yaml.safe_load(CLUSTER_YAML.read_text())["head_start_ray_commands"][-1]
    assert head.index("chmod 600 ~/.ray/auth_token") > head.index("ray start --head")


def test_a_held_job_agent_port_gives_the_head_another_one_and_says_so(tmp_path):
    """Port 52365 (the job agent's, Ray's default) held by another process (a stopped cluster's
    agent lingers for a while, and a job submitted to the new head would land in the dead
    one): ``deploy/start_head.sh`` starts the head with a free agent port and says which. An
    agent port given by hand is left alone."""
    import socket

    log, fake = tmp_path / "calls.log", tmp_path / "ray"
    fake.write_text(
        f'#!/usr/bin/env bash\necho "$*" >> {log}\n'
        'mkdir -p "$HOME/.ray"; echo t > "$HOME/.ray/auth_token"\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "RAY_BIN": str(fake)}
    holder = socket.socket()
    try:
        try:
            holder.bind(("127.0.0.1", 52365))
            holder.listen(1)
        except OSError:  # already held by another process: the case under test all the same
            pass
        for extra in ([], ["--dashboard-agent-listen-port=40001"]):
            out = subprocess.run(
                ["bash", str(ROOT / "deploy" / "start_head.sh"), "--num-cpus=1", *extra],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            start = next(c for c in log.read_text().splitlines()[::-1] if "start --head" in c)
            ports = re.findall(r"--dashboard-agent-listen-port=(\d+)", start)
            if extra:
                assert ports == ["40001"] and "in use" not in out.stderr
            else:
                assert len(ports) == 1 and ports[0] != "52365", start
                assert f"listens on {ports[0]} instead" in out.stderr, out.stderr
    finally:
        holder.close()
