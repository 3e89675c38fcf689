"""clbench: a declarative continual-learning benchmark for LLM post-training."""

__version__ = "0.1.0"
