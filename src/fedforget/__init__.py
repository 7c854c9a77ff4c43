"""fedforget: reproducible federated-learning benchmarks centred on forgetting."""

__version__ = "0.1.0"
