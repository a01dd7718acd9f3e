"""Tidal: data-parallel, expert-parallel serving for Mixture-of-Experts models."""

from typing import Any

from tidal.frontend.outputs import CompletionOutput, RequestOutput
from tidal.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``tidal.LLM``, imported on first use: the one import inside a function in tidal/ that
    is not for an optional dependency, kept on purpose (there is no cycle behind it).

    This package's ``__init__`` runs in every process that imports any ``tidal`` module,
    and ``LLM`` pulls the whole engine stack (torch, transformers: ~2 s, ~250 MiB). The
    light processes must not pay for it: the DP coordinator (``tidal.dp_coordinator.entry``,
    0.2 s -> 2.2 s and 28 -> 247 MiB if this import were eager), the chat-template sandbox
    worker (restarted after every timed-out template: 0.1 s -> 2.1 s), and the bottom
    layer (``tidal.config``, ``tidal.protocol``: no torch, docs/architecture.md#layers)."""
    if name == "LLM":
        from tidal.launch.llm import LLM

        return LLM
    raise AttributeError(f"module 'tidal' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
