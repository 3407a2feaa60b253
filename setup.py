# All configuration lives in pyproject.toml; this file lets older tools run `setup.py develop`.
from setuptools import setup

setup()
