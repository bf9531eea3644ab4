"""The one error for unusable settings, raised by the launcher (recipe configs) and the weights tools (config.json,
layout flags) alike: the message names the field and the fix, and both CLIs print it and exit 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the field and the fix."""
