"""Host memory: the host tier the schedule's host bytes live in (tier.py), the check that
this machine has them (check.py), the node's shared copy of the weights (nodecopy.py), the
CPU backend's caching allocator (cpu_cache.py over cpu_cache.cpp) and the peak-memory meters
(peak.py).
"""
