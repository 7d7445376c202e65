"""Packaging beside pyproject.toml (which holds everything else): ships the repo's top-level
``recipes/`` and ``cluster/`` inside the package, as ``paralayer/_recipes`` and
``paralayer/_cluster``, while they stay where users and docs expect them in a checkout.

Why a setup.py: pyproject's ``[tool.setuptools]`` takes either a found package list or an
explicit one, and the mapped folders are not found (they are not under ``paralayer/``).
paralayer/config/recipes.py reads them from either place.
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["paralayer", "paralayer.*"]) + ["paralayer._recipes", "paralayer._cluster"],
    package_dir={"paralayer._recipes": "recipes", "paralayer._cluster": "cluster"},
    package_data={"paralayer._recipes": ["*.yaml"], "paralayer._cluster": ["profiles/*.yaml", "*.sh"]},
)
