"""Conformance kit (see docs/conformance.md)."""
