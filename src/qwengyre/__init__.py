"""qwengyre: elastic reinforcement learning for long-horizon LLM agents."""

__version__ = "0.1.0"
