"""What differs between the Python versions the package supports (3.10+).

``tomllib`` joined the standard library in 3.11; on 3.10 the ``tomli`` backport (a
dependency there, see pyproject.toml) provides the same API.
"""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["tomllib"]
