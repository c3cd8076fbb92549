"""The data layer's one error type (its own module so files.py and rows.py can both raise it)."""


class DataFileError(ValueError):
    """A data file that cannot be used; the message names the file (and row) and what is wrong."""
