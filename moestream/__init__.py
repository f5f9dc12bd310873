"""moestream: Mixture-of-Experts models larger than GPU memory and RAM, their experts streamed from disk."""

__version__ = "0.1.0"
