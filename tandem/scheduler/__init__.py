"""Scheduling: one token budget per step over waiting and running requests (see scheduler.py)."""

from tandem.scheduler.scheduler import Scheduler, SchedulerStats

__all__ = ["Scheduler", "SchedulerStats"]
