"""Several ranks: joining the process group and checking the ranks agree
(process_group.py), the gradient exchange on the net stream (exchange.py), and how sharded
host state cuts a parameter over the ranks (cut.py).
"""
