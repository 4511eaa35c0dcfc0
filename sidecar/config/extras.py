"""The optional extras: whether one is installed, and how to install it.

Owns: looking a module up without importing it, and the install hint the
mcp extra's errors give. Must not touch: the settings (sidecar.config.settings
asks), os.environ, importing an extra.
"""

from __future__ import annotations

import importlib.util
import sys


def mcp_extra_hint() -> str:
    """How to install the mcp extra into this interpreter. The package is on
    no index: from the checkout, as `make run` does."""
    return (
        "the mcp extra, which `make run` installs; into this interpreter, from the "
        f"checkout: {sys.executable} -m pip install -e '.[mcp]'"
    )


def installed(module: str) -> bool:
    """Whether `module` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False
