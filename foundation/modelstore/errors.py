"""The model store's one error type."""

from __future__ import annotations


class ModelError(Exception):
    """A model could not be fetched, imported or validated.

    The message is meant for the user as is: it names the file or directory at fault, says
    what is wrong with it and what to do about it. The CLI prints it without a traceback.
    """
