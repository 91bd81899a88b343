"""Choosing a plan: the planner and its disk and remapper budgets."""
