"""Builders shared by the test modules: tiny random checkpoints, GGUF writers, reference material.

Test modules import them as `from helpers import tiny` (tests/ is on sys.path through conftest.py); no test
module imports another.
"""
