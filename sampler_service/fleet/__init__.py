"""Engines as one `Backend`, written once for every transport: routing, re-issue and
health (`pool.py`, `routing.py`), the members' table (`table.py`), probes, restarts,
resyncs and the roster (`upkeep.py`), the weight protocol (`weights.py`) and the NCCL
group (`nccl.py`), over what a fleet asks of one engine and of its wire (`member.py`).
An engine in the sampler's process is a fleet of one (`local.py`).
"""
