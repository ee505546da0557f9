"""Typed errors of the planner: every bad or infeasible input becomes one of these.

The CLI turns a :class:`PlanError` into a one-line message on stderr and exit code 2.
"""

from __future__ import annotations


class PlanError(Exception):
    """An input the planner cannot use; the message names the cause and what to change."""


class InputError(PlanError):
    """Malformed or unknown input: a YAML/JSON file, a GPU name, a model name, a flag."""


class InfeasibleError(PlanError):
    """Inputs are well-formed but no deployment satisfies them (memory, SLO, inventory)."""
