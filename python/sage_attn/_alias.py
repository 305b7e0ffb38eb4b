"""install_sageattention_alias(): `import sageattention` resolves to sage_attn.sageattention."""
from __future__ import annotations

import importlib.abc
import importlib.metadata as md
import importlib.util
import pathlib
import re
import sys
import warnings

_NAME = "sageattention"


def _normalized(name):
    return re.sub(r"[-_.]+", "-", name).lower()


class _Distribution(md.Distribution):
    """The metadata of the alias: name `sageattention`, the module's version. In memory only:
    nothing is written to site-packages, and it lives as long as the process."""

    def __init__(self, version):
        self._metadata = (f"Metadata-Version: 2.1\nName: {_NAME}\nVersion: {version}\n"
                          "Summary: sage_attn's implementation of the sageattention API "
                          "(sage_attn.install_sageattention_alias)\n")

    def read_text(self, filename):
        if filename in ("METADATA", "PKG-INFO"):
            return self._metadata
        if filename == "top_level.txt":
            return _NAME + "\n"
        return None

    def locate_file(self, path):
        return pathlib.Path(__file__).parent / path


class _MetadataFinder(importlib.abc.MetaPathFinder):
    """Answers importlib.metadata's search for `sageattention` (and the search for every
    distribution); finds no modules (sys.modules holds the alias)."""

    def __init__(self, version):
        self.dist = _Distribution(version)

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=md.DistributionFinder.Context()):
        name = getattr(context, "name", None)
        if name is None or _normalized(name) == _NAME:
            yield self.dist


def install_sageattention_alias() -> None:
    """Makes `import sageattention` give sage_attn.sageattention (the official package's
    functions, computed by this library) and `importlib.metadata.version("sageattention")` its
    version, for this process. Opt-in, never done on import. Call it before importing code that
    checks for the package once at import (diffusers decides at import whether its "sage"
    backends are usable). Raises RuntimeError where the official package is installed (it is
    not shadowed). Idempotent."""
    from . import sageattention as mod

    current = sys.modules.get(_NAME)
    if current is mod:
        return
    if current is not None or importlib.util.find_spec(_NAME) is not None:
        raise RuntimeError("a 'sageattention' package is installed (or imported) already; "
                           "install_sageattention_alias() does not shadow it")
    try:
        md.version(_NAME)
        raise RuntimeError("distribution metadata for 'sageattention' is installed already; "
                           "install_sageattention_alias() does not shadow it")
    except md.PackageNotFoundError:
        pass
    sys.meta_path.append(_MetadataFinder(mod.__version__))
    sys.modules[_NAME] = mod
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    if dispatch is not None and not getattr(dispatch, "_CAN_USE_SAGE_ATTN", True):
        warnings.warn("diffusers was imported before install_sageattention_alias(): its 'sage' "
                      "attention backends stay disabled in this process; call it before "
                      "importing diffusers", stacklevel=2)
