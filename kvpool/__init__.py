"""kvpool: a KV-cache-centric LLM serving system."""

from kvpool.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so that the pure core and the simulator import without torch.
    if name == "LLM":
        from kvpool.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvpool.sched.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
