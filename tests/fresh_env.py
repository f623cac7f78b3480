"""A fresh virtual environment made by the README's "Installed with pip" lines, holding the
built wheel and only what the wheel declares.

A truly fresh ``pip install maskgrpo_ray-*.whl`` downloads several GB (torch with its CUDA
libraries, Ray, DeepSpeed, ...), which tests cannot afford and CI cannot reach beyond PyPI in
time. This builds the closest thing that still fails where a pip user would, running the
README's own lines (:func:`pip_section`) where it can:

1. a stock ``python -m venv`` (Python 3.11's pip 23 and setuptools 65, no ``wheel``: the
   environment in which issue 42's ``--no-build-isolation`` build failed) and a copy of the
   files git tracks or would track (nothing ignored leaks in), the "checkout";
2. the README's build lines run there as written, in the venv (``python -m pip wheel`` with
   pip's build isolation, which fetches setuptools and wheel from the package index), and what
   they leave in the checkout besides ``dist/`` is an error;
3. the wheel's dependency closure is computed from its own ``Requires-Dist`` (core only, no
   extras), recursively through each installed distribution's metadata (markers evaluated,
   ``ray[default]``'s extra followed); the venv gets one ``.pth`` line pointing at a folder of
   symlinks to exactly those distributions' files in this environment (their top-level packages
   and ``.dist-info`` folders, from each distribution's RECORD; a namespace folder shared with a
   distribution outside the closure, such as ``nvidia/``, is linked entry by entry), and their
   console scripts (``ray``) are written from their entry points;
4. the README's install lines run in the checkout, in the venv, as written but for one thing:
   torch's CPU index (``--index-url https://download.pytorch.org/whl/cpu``) is beyond this
   machine's reach, so its line runs without it (the torch it names is already there, from the
   closure: pip finds it satisfied and fetches at most the packages the stock venv has too old,
   setuptools). ``pip install`` of the wheel resolves its dependencies against the closure.

What it catches: a build line that fails or litters the checkout, an install line that does
not install, an import of a package the wheel does not declare (``ModuleNotFoundError``, as
issue 34's matplotlib), a sub-package or data file missing from the wheel (the built-in
configs), code that reads the repository instead of the installed package. What it does not:
the CPU build of torch (the closure's torch is this environment's), version floors (the closure
is this environment's pinned versions), platform wheels, and a package that a declared
dependency happens to bring (the ast test in ``tests/test_dependencies.py`` holds direct
imports to direct declarations).
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from importlib.metadata import Distribution, PackageNotFoundError, distributions
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def source_copy(dest: Path) -> Path:
    """The files git tracks or would track (not ignored) copied to ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for rel in filter(None, (x.decode() for x in listed)):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's ``Requires-Dist`` that apply without extras, on this interpreter."""
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def clean_path() -> list[str]:
    """``sys.path`` of a fresh interpreter of this environment: the test process's own may hold
    more (``import ray`` appends ``ray/thirdparty_files``, whose vendored psutil would then
    stand in for the real distribution)."""
    out = subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    return [p for p in json.loads(out.stdout) if p]


def _installed(name: str, path: list[str]) -> Distribution:
    found = next(iter(distributions(name=name, path=path)), None)
    if found is None:
        raise PackageNotFoundError(name)
    return found


def closure(reqs: list[Requirement], path: list[str]) -> dict[str, Distribution]:
    """Every distribution ``reqs`` need, recursively (extras followed), as installed on ``path``;
    raises when a needed one is not installed (then ``make`` did not install what the wheel
    declares)."""
    env = default_environment()
    found: dict[str, Distribution] = {}
    todo = [(r, frozenset(r.extras)) for r in reqs]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            dist = found.get(name) or _installed(name, path)
        except PackageNotFoundError:
            raise AssertionError(f"{req} is needed but not installed here") from None
        found[name] = dist
        for text in dist.requires or []:
            sub = Requirement(text)
            wanted = [{**env, "extra": e} for e in ("", *extras)]
            if sub.marker is None or any(sub.marker.evaluate(w) for w in wanted):
                todo.append((sub, frozenset(sub.extras)))
    return found


def _key(dist: Distribution) -> str:
    return canonicalize_name(dist.metadata["Name"])


def _site_paths(dist: Distribution) -> tuple[Path, list[tuple[str, ...]]]:
    """A distribution's folder (site-packages) and its files there (RECORD), as path parts."""
    base = Path(str(dist.locate_file("")))
    record = dist.read_text("RECORD") or ""
    parts = []
    for line in record.splitlines():
        path = line.rsplit(",", 2)[0]
        if path and not path.startswith("..") and "__pycache__" not in path:
            parts.append(tuple(path.split("/")))
    return base, parts


DEPTH = 3  # ownership is resolved this deep; a folder still shared there is linked file by file


def link_plan(wanted: dict[str, Distribution], path: list[str]) -> list[Path]:
    """The files and folders to link so that ``wanted`` are importable and nothing else: for
    each wanted file, its shortest leading folder that only wanted distributions own (owners:
    every distribution installed on ``path``)."""
    owners: dict[tuple[Path, tuple[str, ...]], set[str]] = defaultdict(set)
    for dist in distributions(path=path):
        base, parts = _site_paths(dist)
        name = _key(dist)
        for prefix in {p[:i] for p in parts for i in range(1, min(len(p), DEPTH) + 1)}:
            owners[(base, prefix)].add(name)
    links: set[Path] = set()
    names = set(wanted)
    for dist in wanted.values():
        base, parts = _site_paths(dist)
        if not parts:
            raise AssertionError(f"{_key(dist)} lists no files (no RECORD): cannot link it")
        for p in parts:
            depth = min(len(p), DEPTH)
            i = next((i for i in range(1, depth + 1) if owners[(base, p[:i])] <= names), len(p))
            links.add(base.joinpath(*p[:i]))
    return sorted(links)


README = ROOT / "README.md"
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def pip_section(readme: str | None = None) -> tuple[str, list[list[str]]]:
    """The README's "Installed with pip" section: its text and its ``bash`` blocks, each as its
    command lines (blank lines and whole-line comments dropped): the build lines (in a
    checkout), the install lines (in the checkout: they name ``dist/``), the commands (anywhere).
    """
    text = README.read_text() if readme is None else readme
    start = text.index("## Installed with pip")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end > 0 else len(text)]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    lines = [
        [x for x in b.splitlines() if x.strip() and not x.lstrip().startswith("#")] for b in blocks
    ]
    return section, lines


@dataclass(frozen=True)
class FreshEnv:
    root: Path  # the venv
    wheel: Path
    closure: tuple[str, ...]  # the distributions made importable, sorted
    checkout: Path  # the copy of the working tree the README's build and install lines ran in
    ran: tuple[tuple[str, str], ...] = ()  # (the line as run, its stdout and stderr)

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def env(self, home: Path) -> dict[str, str]:
        """An environment for commands in the venv (as ``activate`` makes it): its bin first, no
        PYTHONPATH, hub downloads off."""
        return venv_env(self.root, home)


def venv_env(root: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    env.update(PATH=f"{root / 'bin'}:{env['PATH']}", HOME=str(home), HF_HUB_OFFLINE="1")
    env["VIRTUAL_ENV"] = str(root)
    return env


def run_line(line: str, cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    """One README line, run by bash as a user types it; its stdout and stderr, or an
    AssertionError naming the line and showing the end of what it printed."""
    out = subprocess.run(
        ["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    printed = out.stdout + out.stderr
    assert out.returncode == 0, f"README line {line!r} exited {out.returncode}:\n{printed[-3000:]}"
    return printed


def _console_scripts(wanted: dict[str, Distribution], bindir: Path) -> None:
    python = bindir / "python"
    for dist in wanted.values():
        for ep in dist.entry_points.select(group="console_scripts"):
            module, _, attr = ep.value.partition(":")
            script = bindir / ep.name
            script.write_text(
                f"#!{python}\nimport sys\nfrom importlib import import_module\n"
                f"obj = import_module({module.strip()!r})\n"
                f"for part in {attr.strip()!r}.split('.'):\n    obj = getattr(obj, part)\n"
                "sys.exit(obj())\n"
            )
            script.chmod(0o755)


def make_fresh_env(tmp: Path) -> FreshEnv:
    """The README's build lines in a stock venv and a copy of the checkout, the closure's
    links, then the README's install lines (the module's docstring says what each step is)."""
    build, install = pip_section()[1][:2]
    root = tmp / "venv"
    base_python = Path(sysconfig.get_config_var("BINDIR")) / "python3"
    subprocess.run([str(base_python), "-m", "venv", str(root)], check=True, timeout=300)
    checkout = source_copy(tmp / "checkout")
    env = venv_env(root, tmp / "home")
    before = set(os.listdir(checkout))
    ran = [(line, run_line(line, checkout, env)) for line in build]
    left = set(os.listdir(checkout)) - before
    assert left == {"dist"}, f"the README's build lines leave {sorted(left)} in the checkout"
    (wheel,) = (checkout / "dist").glob("maskgrpo_ray-*.whl")
    path = clean_path()
    wanted = closure(wheel_requirements(wheel), path)
    wanted.pop("maskgrpo-ray", None)
    _expose(wanted, path, tmp / "exposed", root)
    _console_scripts(wanted, root / "bin")
    for line in install:
        runnable = line.replace(CPU_INDEX, "")  # beyond this machine's reach (docstring, 4.)
        ran.append((runnable, run_line(runnable, checkout, env)))
    return FreshEnv(root, wheel, tuple(sorted(wanted)), checkout, tuple(ran))


def _expose(wanted: dict[str, Distribution], path: list[str], exposed: Path, root: Path) -> None:
    """``wanted``'s files linked under ``exposed``, which one ``.pth`` puts on the venv's path."""
    exposed.mkdir()
    links = link_plan(wanted, path)
    for src in links:
        rel = src.relative_to(Path(str(_site_of(src, wanted))))
        inside = [p for p in links if p != src and src.is_relative_to(p)]
        assert not inside, f"{src} lies inside the linked {inside[0]}: the plan is wrong"
        (exposed / rel).parent.mkdir(parents=True, exist_ok=True)
        (exposed / rel).symlink_to(src, target_is_directory=src.is_dir())
    purelib = subprocess.run(
        [
            str(root / "bin" / "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "_maskgrpo_closure.pth").write_text(f"{exposed}\n")


def _site_of(path: Path, wanted: dict[str, Distribution]) -> Path:
    for dist in wanted.values():
        base = Path(str(dist.locate_file("")))
        if path.is_relative_to(base):
            return base
    raise AssertionError(f"{path} is in no wanted distribution's folder")
