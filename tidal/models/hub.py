"""``--model`` as people type it: a checkpoint folder, or a Hugging Face repo id
(``ORG/NAME``) resolved to its snapshot folder.

A repo id is looked up in the local Hugging Face cache first (``HF_HUB_CACHE`` /
``HF_HOME``; works offline). Only when it is not there, and ``HF_HUB_OFFLINE`` is unset,
is the snapshot downloaded: the files a serving rank reads (configs, tokenizer files,
safetensors shards), never a repository's other weights formats. When neither works the
error names the repo id, the revision and the cache folder it looked in.
"""

from __future__ import annotations

import os
import re

# What serving reads from a snapshot: no *.bin / *.pt / *.gguf copies of the same weights.
SERVING_FILES = (
    "*.json",
    "*.safetensors",
    "*.model",  # sentencepiece
    "*.tiktoken",
    "*.txt",  # merges
    "*.jinja",  # chat templates
    "*.py",  # auto_map code: only ever run with --trust-remote-code
)

# ``org/name`` as the hub spells repo ids (one slash; no leading dot or dash).
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


class ModelNotFound(ValueError):
    """``--model`` names neither a folder nor a repo id that could be resolved."""


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and ".." not in model


def resolve_model_path(
    model: str,
    revision: str | None = None,
    *,
    cache_dir: str | None = None,
    endpoint: str | None = None,
) -> str:
    """The local folder to serve ``model`` from (a folder is returned as it is).

    ``revision``: a branch, tag or commit of the repo (default ``main``); ignored for a
    folder. ``endpoint``: the hub's URL (default ``HF_ENDPOINT`` / huggingface.co). Raises ``ModelNotFound`` naming what was tried."""
    if os.path.isdir(model):
        return model
    if not looks_like_repo_id(model):
        raise ModelNotFound(
            f"model: {model!r} is neither a directory nor a Hugging Face repo id (ORG/NAME)"
        )
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = cache_dir or constants.HF_HUB_CACHE
    rev = revision or "main"
    try:
        return snapshot_download(
            model, revision=rev, cache_dir=cache, local_files_only=True,
            allow_patterns=list(SERVING_FILES),
        )  # fmt: skip
    except (LocalEntryNotFoundError, HFValidationError, OSError) as e:
        cached_error: Exception = e
    if _offline():
        raise ModelNotFound(
            f"model: {model!r} (revision {rev!r}) is not in the Hugging Face cache at {cache} "
            f"and HF_HUB_OFFLINE is set, so it was not downloaded ({cached_error})"
        )
    try:
        return snapshot_download(
            model, revision=rev, cache_dir=cache, endpoint=endpoint,
            allow_patterns=list(SERVING_FILES),
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the hub's errors are many; all end here
        raise ModelNotFound(
            f"model: {model!r} (revision {rev!r}) is not in the Hugging Face cache at {cache} "
            f"and downloading it failed: {type(e).__name__}: {e}"
        ) from e


def _offline() -> bool:
    # Read at call time (the hub's constants module reads it once, at its import).
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
