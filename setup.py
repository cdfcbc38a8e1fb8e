"""Package discovery; the rest of the build configuration is in pyproject.toml.

Every package under ``shardspec/`` is found, with or without an ``__init__.py``, so a new
one cannot be left out of the wheel (``tests/test_packaging.py`` checks the built wheel),
plus ``shardspec.grammars``: the grammar lives in ``grammars/`` at the top of the repository
and installs as that data-only package (``package-dir`` in pyproject.toml), which no
discovery under ``shardspec/`` can see.
"""

from setuptools import find_namespace_packages, setup

PACKAGES = find_namespace_packages(include=["shardspec", "shardspec.*"], exclude=["*.__pycache__"])

setup(packages=[*PACKAGES, "shardspec.grammars"])
