"""Scheduling: one token budget per step over waiting and running requests (see scheduler.py)."""

from tandem.scheduler.policies import FCFSQueue, PriorityQueue, make_waiting_queue
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.stats import SchedulerStats

__all__ = ["FCFSQueue", "PriorityQueue", "Scheduler", "SchedulerStats", "make_waiting_queue"]
