"""Checkpoints: the training state written atomically and loaded again (checkpoint.py),
each rank's part through torch.distributed.checkpoint (dcp_state.py), and a checkpoint
exported as plain files (export.py).
"""
