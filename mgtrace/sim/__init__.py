"""Deterministic engine simulator: scheduler, runner bookkeeping and injectable upstream bugs."""

from mgtrace.sim.config import BUGS, RUNNERS, SCENARIOS, SimConfig
from mgtrace.sim.engine import simulate

__all__ = ["BUGS", "RUNNERS", "SCENARIOS", "SimConfig", "simulate"]
