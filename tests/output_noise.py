"""What a user's run may print: its own lines, and no third-party warning they cannot act on.

Issue 42: every train, eval and API call printed Ray's "Token authentication is enabled for this
Ray cluster. Set RAY_AUTH_MODE=disabled to opt out" and DeepSpeed's "Setting accelerator to CPU.
If you have GPU or other accelerator, we were unable to detect it." Both are now answered at
their source (``maskgrpo_ray.cluster.attach.choose_token_auth``,
``maskgrpo_ray.weights.safe_files.deepspeed_accelerator``); these patterns find any warning of that kind
that comes back, or a new one.
"""

from __future__ import annotations

import re

# our loggers' lines (the commands' format: "<time> LEVEL maskgrpo_ray.x.y: message")
OURS = re.compile(r"\b(WARNING|ERROR) maskgrpo(_ray)?[.:]")
# a logging warning in any library's format ("WARNING", "[WARNING]", "W1126 ..." from glog is
# rarer), or a Python warning ("UserWarning: ...", "FutureWarning: ...")
WARNING_LINE = re.compile(r"\bWARN(ING)?\b|\b\w*Warning: ")
KNOWN = ("Token authentication is enabled", "Setting accelerator to CPU")


def third_party_warnings(text: str) -> list[str]:
    """The lines of ``text`` that are a warning and not one of ours."""
    return [
        line
        for line in text.splitlines()
        if (WARNING_LINE.search(line) or any(k in line for k in KNOWN)) and not OURS.search(line)
    ]
