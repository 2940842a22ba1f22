"""jaxrl: JAX-native RL post-training for language models on one device mesh."""

__version__ = "0.1.0"
