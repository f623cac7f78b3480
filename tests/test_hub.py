"""Models and rewards by hub id (maskgrpo_ray.weights.hub) against a local stand-in for the hub.

The stand-in is a stdlib HTTP server on 127.0.0.1 serving the endpoints huggingface_hub calls
for ``snapshot_download``: ``GET /api/models/{repo}/revision/{rev}`` (repo_info),
``GET /api/models/{repo}/tree/{commit}`` (list_repo_tree) and ``HEAD``/``GET
/{repo}/resolve/{commit}/{file}`` (ETag, X-Repo-Commit, Content-Length). huggingface_hub freezes
HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE when first imported, so every resolve runs in a
subprocess whose environment points it at the server and a temporary HF_HOME. Never the
internet: the only endpoints are 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMIT = "a" * 40  # the one commit of every stand-in repository (main)


@dataclass
class Hub:
    """The stand-in's repositories (``repo id -> {path: bytes}``) and the requests it saw."""

    repos: dict[str, dict[str, bytes]]
    requests: list[tuple[str, str]] = field(default_factory=list)
    url: str = ""

    def file_requests(self) -> list[tuple[str, str]]:
        return [r for r in self.requests if "/resolve/" in r[1]]


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for k, v in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, data: object) -> None:
            self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"})

        def _missing(self, code: str) -> None:
            self._send(404, b"{}", {"X-Error-Code": code, "X-Error-Message": code})

        def _route(self) -> None:
            path = self.path.split("?")[0]
            hub.requests.append((self.command, path))
            api = re.match(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?)?$", path)
            res = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            repo_id = (api or res).group(1) if (api or res) else None
            files = hub.repos.get(repo_id or "")
            if files is None:
                return self._missing("RepoNotFound")
            rev = (api.group(3) or "main") if api else res.group(2)  # type: ignore[union-attr]
            if rev not in ("main", COMMIT):
                return self._missing("RevisionNotFound")
            if api and api.group(2) in ("revision", None):  # repo_info
                siblings = [{"rfilename": p} for p in files]
                return self._json({"id": repo_id, "sha": COMMIT, "siblings": siblings})
            if api:  # list_repo_tree, recursive, one page
                tree = [
                    {"type": "file", "path": p, "size": len(b), "oid": _oid(b)}
                    for p, b in files.items()
                ]
                return self._json(tree)
            name = res.group(3)  # type: ignore[union-attr]
            if name not in files:
                return self._missing("EntryNotFound")
            body = files[name]
            headers = {"ETag": f'"{_oid(body)}"', "X-Repo-Commit": COMMIT}
            return self._send(200, body, headers)

        do_GET = do_HEAD = _route

    return Handler


def _oid(body: bytes) -> str:
    return hashlib.sha1(body).hexdigest()


def _tiny_amused_files(tmp: Path) -> dict[str, bytes]:
    from maskgrpo_ray.models.amused_loading import save_tiny_random_amused

    folder = save_tiny_random_amused(tmp / "amused")
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    tmp = tmp_path_factory.mktemp("hubrepos")
    clip_config = {"model_cfg": {"embed_dim": 8}, "preprocess_cfg": {}}
    repos = {
        "tiny/amused": _tiny_amused_files(tmp),
        "tiny/clip": {
            "open_clip_config.json": json.dumps(clip_config).encode(),
            "open_clip_model.safetensors": b"stand-in weights",
            "pytorch_model.bin": b"transformers' weights: not fetched (allow_patterns)",
        },
        "tiny/imagereward": {
            "ImageReward.pt": b"stand-in checkpoint",
            "med_config.json": b"{}",
            "README.md": b"not fetched",
        },
        "tiny/bert": {"vocab.txt": b"[PAD]\n", "config.json": b"{}", "model.safetensors": b"no"},
        "tiny/pickscore": {
            "config.json": b"{}",
            "model.safetensors": b"stand-in weights",
            "pytorch_model.bin": b"not fetched (ignore_patterns)",
        },
    }
    state = Hub(repos)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    thread.join(timeout=10)


def _env(hf_home: Path, endpoint: str, offline: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MASKGRPO_"))}
    env.update(HF_HOME=str(hf_home), HF_ENDPOINT=endpoint, HF_HUB_DISABLE_TELEMETRY="1")
    env.update(HF_HUB_DISABLE_XET="1", HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


RESOLVE = """
import json, sys
from maskgrpo_ray.errors import one_line
from maskgrpo_ray.weights.hub import HubError, HubField, parse_hub_id, resolve_ref
ref = parse_hub_id(sys.argv[1])
try:
    r = resolve_ref("model.args.path", ref, HubField("args.path"), download=sys.argv[2] == "1")
except HubError as err:
    print("ERROR " + one_line(str(err)))
else:
    folder = str(r.folder) if r.folder else None
    print(json.dumps({"folder": folder, "commit": r.commit, "hit": r.cache_hit}))
"""


def _resolve(hub_id: str, env: dict[str, str], download: bool = True) -> str:
    out = subprocess.run(
        [sys.executable, "-c", RESOLVE, hub_id, "1" if download else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


TRAIN = """
import json, sys
from maskgrpo_ray.cli import app as cli
seen = {}
def run_train(cfg, run_dir, resume_from=None, prompts=None):
    seen["cfg"] = cfg.model_dump(mode="json")  # the config RayExecutor hands the actors
    return {}
cli.run_train = run_train
code = cli.main(sys.argv[1:])
print("CONFIG " + json.dumps(seen.get("cfg")))
sys.exit(code)
"""


def _train(env: dict[str, str], run_dir: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    argv = ["train", "--config", "configs/amused_tiny_random.yaml", "--run-dir", str(run_dir)]
    for s in sets:
        argv += ["--set", s]
    return subprocess.run(
        [sys.executable, "-c", TRAIN, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_train_downloads_once_then_hits_the_cache_and_actors_get_local_folders(hub, tmp_path):
    """``maskgrpo train`` with an aMUSEd model and a CLIP reward by hub id: the first run
    downloads (progress bars and one log line per repo), the config the actors get holds the
    snapshot folders; a second resolve is a cache hit and fetches no file."""
    env = _env(tmp_path / "hf", hub.url)
    sets = (
        "model.args.path=hf://tiny/amused@main",
        "reward.components=[{kind: clip, args: {model_name: 'hf://tiny/clip'}}]",
    )
    hub.requests.clear()
    first = _train(env, tmp_path / "run1", *sets)
    assert first.returncode == 0, first.stderr[-3000:]
    n_files = len(hub.repos["tiny/amused"]) + 2  # clip: config + safetensors, not the .bin
    got = [p for m, p in hub.file_requests() if m == "GET"]
    assert len(got) == n_files, got
    assert not any(p.endswith("pytorch_model.bin") for p in got)
    log = first.stderr
    assert "Fetching" in log and "files" in log, log[-2000:]  # huggingface_hub's progress bar
    snap = tmp_path / "hf" / "hub" / "models--tiny--amused" / "snapshots" / COMMIT
    line = (
        f"hub model.args.path: tiny/amused revision main = commit {COMMIT} at {snap} (downloaded)"
    )
    assert line in log, log[-2000:]
    assert "hub reward.components[0].args.model_name: tiny/clip revision main" in log
    cfg = json.loads(first.stdout.split("CONFIG ", 1)[1])
    assert cfg["model"]["args"]["path"] == str(snap)
    clip_snap = tmp_path / "hf" / "hub" / "models--tiny--clip" / "snapshots" / COMMIT
    assert cfg["reward"]["components"][0]["args"]["model_name"] == f"local-dir:{clip_snap}"
    assert (snap / "transformer" / "diffusion_pytorch_model.safetensors").is_file()

    hub.requests.clear()  # a second resolve, in a fresh process on the same HF_HOME
    second = json.loads(_resolve("hf://tiny/amused@main", env))
    assert second == {"folder": str(snap), "commit": COMMIT, "hit": True}
    assert hub.file_requests() == []  # no file HEAD or GET: every file came from the cache
    assert hub.requests == [("GET", "/api/models/tiny/amused/revision/main")]  # main -> commit


TRAIN_API = """
import json, sys
from maskgrpo_ray.cli import app as cli
import maskgrpo_ray as mg
seen = {}
def run_train(cfg, run_dir, resume_from=None, prompts=None):
    seen["cfg"] = cfg.model_dump(mode="json")
    return {"completed": True}
cli.run_train = run_train
out = mg.train("configs/amused_tiny_random.yaml", sys.argv[2:], run_dir=sys.argv[1])
print("SUMMARY " + json.dumps(out))
print("CONFIG " + json.dumps(seen["cfg"]))
"""


def test_the_python_api_trains_on_the_same_path_hub_ids_resolved(hub, tmp_path):
    """``maskgrpo_ray.train`` resolves hub ids to snapshot folders before the run starts, as
    ``maskgrpo train`` does (issue 34: ``cli.run_train`` alone skipped the resolution)."""
    env = _env(tmp_path / "hf", hub.url)
    sets = ["model.args.path=hf://tiny/amused@main", "reward.components=[{kind: toy_rules}]"]
    out = subprocess.run(
        [sys.executable, "-c", TRAIN_API, str(tmp_path / "run"), *sets],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    snap = tmp_path / "hf" / "hub" / "models--tiny--amused" / "snapshots" / COMMIT
    cfg = json.loads(out.stdout.split("CONFIG ", 1)[1])
    assert cfg["model"]["args"]["path"] == str(snap)
    summary = json.loads(out.stdout.split("SUMMARY ", 1)[1].split("\n", 1)[0])
    assert summary == {"completed": True, "run_dir": str(tmp_path / "run")}


def test_offline_with_an_empty_cache_is_one_line(hub, tmp_path):
    hub.requests.clear()
    out = _resolve("hf://tiny/amused@main", _env(tmp_path / "hf", hub.url, offline=True))
    assert out == (
        "ERROR model.args.path: hub id 'hf://tiny/amused@main' (revision main) is not in the "
        "cache and the hub may not be contacted; HF_HUB_OFFLINE is on, endpoint "
        f"{hub.url}; fix: unset HF_HUB_OFFLINE where the hub is reachable, or point "
        "model.args.path at a local folder holding the repo's files (e.g. `hf download "
        "tiny/amused --revision main --local-dir DIR` where the hub is reachable)"
    )
    assert hub.requests == []  # offline: the hub was not contacted


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed when the block ends: nothing listens there


def test_an_unreachable_endpoint_is_one_line(tmp_path):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    out = _resolve("hf://tiny/amused", _env(tmp_path / "hf", endpoint))
    assert out == (
        "ERROR model.args.path: hub id 'hf://tiny/amused' (revision main) cannot be reached "
        "and is not in the cache (ConnectError); HF_HUB_OFFLINE is off, endpoint "
        f"{endpoint}; fix: point model.args.path at a local folder holding the repo's files "
        "(e.g. `hf download tiny/amused --revision main --local-dir DIR` where the hub is "
        "reachable)"
    )


@pytest.mark.parametrize(
    ("hub_id", "why"),
    [
        ("hf://tiny/amused@v9", "(revision v9) names no revision of that repository"),
        ("hf://tiny/nothing", "(revision main) is no repository there"),
    ],
)
@pytest.mark.parametrize("download", [True, False], ids=["train", "validate"])
def test_a_missing_revision_or_repo_is_one_line(hub, tmp_path, hub_id, why, download):
    out = _resolve(hub_id, _env(tmp_path / "hf", hub.url), download=download)
    assert out.startswith(f"ERROR model.args.path: hub id '{hub_id}' {why}"), out
    assert "\n" not in out


def test_validate_checks_the_hub_but_fetches_nothing(hub, tmp_path):
    hub.requests.clear()
    out = json.loads(_resolve("hf://tiny/amused", _env(tmp_path / "hf", hub.url), download=False))
    assert out == {"folder": None, "commit": COMMIT, "hit": False}
    assert hub.requests == [("GET", "/api/models/tiny/amused")]  # repo_info of main
    assert not (tmp_path / "hf" / "hub" / "models--tiny--amused").exists()


def test_hub_ids_are_explicit():
    """Only ``hf://org/name[@revision]`` is a hub id: a bare name or a path is left alone (the
    old rule: local folder or HF cache, no download)."""
    from maskgrpo_ray.weights.hub import HubError, HubRef, parse_hub_id

    assert parse_hub_id("hf://showlab/show-o-512x512") == HubRef("showlab/show-o-512x512", None)
    assert parse_hub_id("hf://a/b@refs/pr/3") == HubRef("a/b", "refs/pr/3")
    for value in ("showlab/show-o-512x512", "runs/amused-tiny-random", "ViT-H-14", None, 3):
        assert parse_hub_id(value) is None
    for bad in ("hf://showlab", "hf://a/b/c", "hf://a/b@"):
        with pytest.raises(HubError, match="not a hub id"):
            parse_hub_id(bad)


RESOLVE_CONFIG = """
import json, sys
from maskgrpo_ray.config import load_config
from maskgrpo_ray.weights.hub import resolve_config
cfg = load_config("configs/toy.yaml", sys.argv[1:])
cfg, found = resolve_config(cfg)
out = cfg.model_dump(mode="json")
print(json.dumps({"reward": out["reward"]["components"][1]["args"],
                  "metric": out["eval"]["metrics"][0], "found": len(found)}))
"""


def test_imagereward_and_pickscore_by_hub_id_resolve_to_their_files(hub, tmp_path):
    """ImageReward's checkpoint (a file: ``ImageReward.pt`` of the snapshot) and tokenizer as a
    reward component, PickScore's weights as an evaluation metric: each hub id becomes the
    local path the component reads; only the files it reads are fetched."""
    sets = [
        "reward.components=[{kind: toy_rules, weight: 1.0}, {kind: imagereward, weight: 0.5, "
        "args: {checkpoint: 'hf://tiny/imagereward', tokenizer: 'hf://tiny/bert'}}]",
        "eval.metrics=[{kind: pickscore, weights: 'hf://tiny/pickscore'}]",
    ]
    env = _env(tmp_path / "hf", hub.url)
    hub.requests.clear()
    out = subprocess.run(
        [sys.executable, "-c", RESOLVE_CONFIG, *sets],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["found"] == 3
    ckpt = Path(got["reward"]["checkpoint"])
    assert ckpt.name == "ImageReward.pt" and ckpt.read_bytes() == b"stand-in checkpoint"
    assert (Path(got["reward"]["tokenizer"]) / "vocab.txt").is_file()
    weights = Path(got["metric"]["weights"])
    assert (weights / "model.safetensors").is_file() and not (
        weights / "pytorch_model.bin"
    ).exists()
    fetched = {p for m, p in hub.requests if m == "GET" and "/resolve/" in p}
    assert not any(p.endswith(("README.md", "pytorch_model.bin")) for p in fetched), fetched
    assert not any("tiny/bert" in p and p.endswith("model.safetensors") for p in fetched)
