"""Kafila: pool a trusted group's machines to serve one large language model."""

__version__ = "0.1.0"
