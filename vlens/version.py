"""The version, in a module of its own so that any part of vlens can read it without importing vlens."""

__version__ = "0.2.0"
