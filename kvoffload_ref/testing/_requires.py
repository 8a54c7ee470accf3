"""The conformance kit's one dependency: Hypothesis. Imported first by the package, so that a missing Hypothesis
fails with one line naming the install command instead of a bare ``ModuleNotFoundError`` from deep inside."""

from __future__ import annotations

from typing import Final

__all__ = ["INSTALL_HINT", "HypothesisMissing"]

#: How to install the kit's dependency (the conformance extra's one requirement: it works however kvoffload_ref
#: itself was installed -- from a checkout, a wheel or a VCS URL; the package is not on PyPI).
INSTALL_HINT: Final = 'pip install "hypothesis>=6.100"'


class HypothesisMissing(ModuleNotFoundError):
    """The conformance kit needs Hypothesis, which is not installed (the message names the install command)."""


try:
    import hypothesis  # noqa: F401  (only: is it there?)
except ModuleNotFoundError as missing:
    if missing.name != "hypothesis":
        raise
    raise HypothesisMissing(f"kvoffload_ref.testing needs Hypothesis, which is not installed: {INSTALL_HINT}",
                            name="hypothesis") from None
