"""Backends: where compute runs and how the streams order work, behind one contract
(backend.py, with the CPU backend; cuda_backend.py). The engine never names a device API.
"""
