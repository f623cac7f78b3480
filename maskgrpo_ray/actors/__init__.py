"""``maskgrpo_ray.actors`` in a checkout: the package is the repository's top-level ``actors/``.

An installed package (wheel or editable) maps ``actors/`` here through pyproject's
``package-dir``. A checkout on the path (``PYTHONPATH=.``, ``ray job submit --working-dir .``)
imports this file instead: it points the package's ``__path__`` at ``actors/`` and runs that
folder's ``__init__.py``, so ``maskgrpo_ray.actors.pool`` is ``actors/pool.py`` either way. The wheel ships
``actors/__init__.py`` here, never this file (pyproject's ``exclude-package-data``).
"""

import pathlib as _pathlib

_FOLDER = _pathlib.Path(__file__).resolve().parents[2] / "actors"
_INIT = _FOLDER / "__init__.py"
if not _INIT.is_file():
    raise ImportError(
        f"{__name__}: {_INIT} is missing: this checkout lacks its top-level actors/ "
        "folder; check out the whole repository, or install the package (pip install .)"
    )
__path__ = [str(_FOLDER)]
del _pathlib
exec(compile(_INIT.read_text(), str(_INIT), "exec"))
