"""The package version, in a module of its own so that deep modules never import ``fastdata``."""
__version__ = "0.1.0"
