"""Tidal: data-parallel, expert-parallel serving for Mixture-of-Experts models."""

from tidal.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing tidal must not pull torch for light tools
    if name == "LLM":
        from tidal.launch.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from tidal.frontend import outputs

        return getattr(outputs, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
