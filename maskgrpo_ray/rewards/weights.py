"""Where a reward model's files are: local paths, the Hugging Face cache, the hub, and the error
that says what is missing.

A reward looks its weights (and tokenizer files) up when it is constructed (and ``maskgrpo``
looks them up before any actor starts), so that a run fails at start, not after the first
rollout. Nothing is downloaded unless asked: a file that is not here fails at once, unless
``MASKGRPO_ALLOW_DOWNLOADS=1`` lets the hub fetch it (never with ``HF_HUB_OFFLINE`` set).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from maskgrpo_ray.errors import UserError


class RewardWeightsMissingError(UserError, FileNotFoundError):
    """A reward model's weights (or tokenizer files) are not on this machine.

    Raised when the reward is constructed, so that a reward actor fails at start, not after the
    first rollout. The message names the missing file, where it was looked for, and how to
    provide it.
    """


def hf_hub_offline() -> bool:
    """True when the Hugging Face hub must not be contacted (``HF_HUB_OFFLINE`` set).

    Reads the environment as well as ``huggingface_hub.constants``, which freezes the variable
    when ``huggingface_hub`` is first imported.
    """
    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return env
    return env or bool(constants.HF_HUB_OFFLINE)


ALLOW_DOWNLOADS_ENV = "MASKGRPO_ALLOW_DOWNLOADS"


def downloads_allowed() -> bool:
    """A file that is not here may be fetched from the hub: only when asked
    (``MASKGRPO_ALLOW_DOWNLOADS=1``) and the hub is not offline (``HF_HUB_OFFLINE``)."""
    asked = os.environ.get(ALLOW_DOWNLOADS_ENV, "").strip().lower() in {"1", "true", "yes", "on"}
    return asked and not hf_hub_offline()


def find_in_hf_cache(repo_id: str, filename: str, cache_dir: str | None = None) -> str | None:
    """Path of ``filename`` of ``repo_id`` in the Hugging Face cache, or None if not cached."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir)
    return found if isinstance(found, str) and os.path.isfile(found) else None


def hf_cache_dir(cache_dir: str | None = None) -> str:
    """The Hugging Face hub cache folder that a look-up with ``cache_dir`` uses."""
    if cache_dir is not None:
        return str(cache_dir)
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def missing_weights_message(what: str, file: str, looked_in: Sequence[str], how: str) -> str:
    """The text of a :class:`RewardWeightsMissingError`: what, which file, where, and how to fix."""
    places = "\n".join(f"  - {p}" for p in looked_in)
    return (
        f"{what}: file {file!r} not found.\nLooked in:\n{places}\nHow to provide it:\n"
        f"{how}\n  - Or let the project download it from the Hugging Face hub: set "
        f"{ALLOW_DOWNLOADS_ENV}=1 (nothing is downloaded unless asked)."
    )


def missing(what: str, file: str, looked_in: Sequence[str], how: str) -> RewardWeightsMissingError:
    """The error for a missing ``file`` of ``what`` (:func:`missing_weights_message`)."""
    return RewardWeightsMissingError(missing_weights_message(what, file, looked_in, how))


def hf_cache_place(cache_dir: str | None = None) -> str:
    """The Hugging Face cache as a place looked in (a line of a missing-weights message)."""
    return f"Hugging Face cache {hf_cache_dir(cache_dir)}"


def hf_cached_file(
    what: str, repo_id: str, filename: str, cache_dir: str | None, how: str
) -> str | None:
    """Path of ``repo_id``'s ``filename`` in the Hugging Face cache; None when it is not cached
    and a download is allowed (:func:`downloads_allowed`).

    Raises:
        RewardWeightsMissingError: not cached, and no download allowed.
    """
    cached = find_in_hf_cache(repo_id, filename, cache_dir)
    if cached is None and not downloads_allowed():
        raise missing(what, f"{repo_id}/{filename}", [hf_cache_place(cache_dir)], how)
    return cached
