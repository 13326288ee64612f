"""Sluice operator: InferenceEndpoint -> the Kubernetes objects that serve it."""

__version__ = "0.1.0"
