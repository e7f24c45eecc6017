"""kvoffload as vLLM's offloading spec, driven by vLLM's own scheduler and connector on CPU."""
