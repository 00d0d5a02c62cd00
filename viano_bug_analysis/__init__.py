"""Seed 001's import names for the case builder's Python API.

The specification's own example imports ``viano_bug_analysis.case`` and
``viano_bug_analysis.lifecycle``; the code lives in ``pipeline/`` (one module
per concern, ARCHITECTURE.md section 1), and these modules only re-export it,
so either name gives the same objects.
"""
