"""Engines as one `Backend`, written once for every transport: the members' table,
routing, probes, recovery and health (`pool.py`, `table.py`, `routing.py`), the weight
protocol (`weights.py`) and the NCCL group (`nccl.py`), over what a fleet asks of one
engine (`member.py`). An engine in the sampler's process is a fleet of one (`local.py`).
"""
