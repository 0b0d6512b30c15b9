"""Checks of karma's promises that its tests and benchmarks run, and that a user can run on a
model of their own:

- exactness.py: a model file planned in process and trained by the runtime, beside the plain
  PyTorch loop (karma.reference), their parameters compared bit for bit;
- fuzz.py (with mutations.py): valid schedules mutated, and each mutant judged as karma-run
  would run it: refused with one line, or trained bitwise equal;
- autograd_saved.py: what autograd really saves, measured by running a model: the ground
  truth the IR's saved bytes are held against.
"""
