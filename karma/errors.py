"""Errors that reach the user as a short message and exit code 2.

Everything karma raises on bad input is a `KarmaError`: its message names the problem and
the fix. The command-line entry points print it without a traceback (unless --debug).
"""

from __future__ import annotations


class KarmaError(Exception):
    """Bad input or an impossible request; the message says what and how to fix it."""

    exit_code = 2


class ModelFileError(KarmaError):
    """The model file is missing, broken, or does not follow the model-file protocol."""


class IRError(KarmaError):
    """The model could not be traced or grouped into blocks."""
