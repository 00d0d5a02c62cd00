"""The Viano case builder: deterministic, provenance-carrying bug cases."""

BUILDER_VERSION = "1"
