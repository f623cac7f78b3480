"""``python -m maskgrpo_ray.cli ...``: the ``maskgrpo`` command (what the job entrypoints run)."""

import sys

from maskgrpo_ray.cli.app import main

sys.exit(main())
