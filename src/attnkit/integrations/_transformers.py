"""Hugging Face transformers, imported on demand and checked against the versions attnkit supports."""

from __future__ import annotations

# the versions attnkit.integrations is tested against (the `hf` extra's pin); 5.0-5.3 built masks from
# `cache_position`
SUPPORTED_TRANSFORMERS = (">=5.4", "<6")
_MIN_VERSION, _MAX_VERSION = "5.4", "6"


def _transformers():
    """Import transformers and check its version; return ``(transformers, masking_utils)``."""
    try:
        import transformers
        from transformers import masking_utils
    except ImportError as e:
        raise ImportError(
            "attnkit.integrations.hf needs Hugging Face transformers "
            f"{','.join(SUPPORTED_TRANSFORMERS)}: install it with pip install 'attnkit[hf]'"
        ) from e
    _check_version(transformers.__version__)
    return transformers, masking_utils


def _check_version(version: str) -> None:
    from packaging.version import Version  # a dependency of transformers

    release = Version(Version(version).base_version)  # 6.0.0rc1 counts as 6.0.0, 5.25.0.dev0 as 5.25.0
    if not Version(_MIN_VERSION) <= release < Version(_MAX_VERSION):
        raise RuntimeError(
            f"attnkit.integrations.hf supports transformers {','.join(SUPPORTED_TRANSFORMERS)}, "
            f"found {version}: install a supported version with pip install 'attnkit[hf]'"
        )
