"""``from viano_bug_analysis.case import CaseBuilder, CaseBuildError`` (seed 001)."""

from pipeline.assemble import CaseAssembler
from pipeline.build import CaseBuilder
from pipeline.errors import CaseBuildError
from pipeline.limits import CaseBuilderLimits
from pipeline.summary import render_summary

__all__ = ["CaseAssembler", "CaseBuilder", "CaseBuildError", "CaseBuilderLimits", "render_summary"]
