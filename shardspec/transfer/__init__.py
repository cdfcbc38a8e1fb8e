"""Planning a weight transfer between two specs (``shardspec transfer``): the compiler
side, without torch. See :mod:`shardspec.transfer.plan` for the plan's JSON format."""

from shardspec.transfer.plan import FORMAT, Plan, plan_json, plan_transfer
from shardspec.transfer.report import render_text

__all__ = ["FORMAT", "Plan", "plan_json", "plan_transfer", "render_text"]
