"""Errors that reach the user as one clear line (the CLI prints them without a traceback)."""


class MoestreamError(Exception):
    """A problem with the user's input or environment, stated in one line."""


class FormatError(MoestreamError):
    """A packed model directory that is missing, incomplete, corrupt or inconsistent."""


class NoTokenizerError(FormatError):
    """Text was given to a model without tokenizer files (e.g. a synthetic one): token ids only."""


class UnsupportedModelError(MoestreamError):
    """A checkpoint whose family or layout moestream cannot run."""


class ExpertReadError(MoestreamError):
    """Reading an expert record failed (I/O error, short read, checksum mismatch)."""


class BudgetError(MoestreamError):
    """A --memory-budget too small for the model's fixed parts and its fewest expert slots (a usage error)."""
