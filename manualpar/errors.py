"""Exception types raised by manualpar.

Each one subclasses the built-in type a caller would naturally catch (ValueError, RuntimeError,
TimeoutError), so code written against plain torch keeps working, while tests and users can match
the precise failure.
"""

from __future__ import annotations


class ManualParError(Exception):
    """Base class of every error manualpar raises on purpose."""


class ClusterEnvironmentError(ManualParError, ValueError):
    """The rank/world variables of the launcher are missing or contradict each other."""


class CollectiveError(ManualParError, RuntimeError):
    """A collective failed or timed out; the message names the operation and this rank."""


class DataError(ManualParError, ValueError):
    """A rank's data is not what the loop can take: a batch of None (the loop's "no batch"),
    raised on every rank at the same step naming the rank and the batch index; a bad data file
    (DataFileError)."""


class DataFileError(DataError):
    """A data file is not what its reader expects: a line not in the format (the message names
    the file and the 1-based line), a truncated gzip, fewer lines than asked for, or reader
    settings that do not fit the files (no files, a batch not divisible by the ranks)."""


class CheckpointError(ManualParError, RuntimeError):
    """A checkpoint could not be written or read (partial, corrupted, unwritable, not one)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint does not fit the objects it is loaded into (missing/extra keys, shapes)."""


class BuilderError(ManualParError, ValueError):
    """A builder was misused: a module wrapped twice, a parameter claimed by two builders, an
    optimizer created before setup, a submodule that cannot be initialized."""


class EmbeddingInputError(ManualParError, ValueError):
    """A sparse batch does not fit the embedding tables: an id out of range, lengths and ids that
    disagree, an unknown or missing feature, a wrong dtype. The message names the feature/table."""


class PlanError(ManualParError, ValueError):
    """An embedding sharding plan does not fit the tables or the world size (a table left out,
    a rank that does not exist, a budget that cannot hold the tables)."""


class NonFiniteError(ManualParError, ValueError):
    """`check_finite` found NaN or inf in a tensor; the message names the tensor, the count and
    the first bad index."""


class MeshError(ManualParError, ValueError):
    """A device mesh does not fit the job: sizes that do not multiply to the world size, a dim
    name that does not exist, a node layout other than the launcher's."""


class StorageError(ManualParError, OSError):
    """Rows on disk are not what the disk tier wrote: a row file shorter than its table block,
    or one that another process changed. The message names the table, rank and file."""


class OutputPathError(ManualParError, OSError):
    """A Trainer output cannot be written where it goes (the TensorBoard log directory is a
    file or read-only). The message names the path and what to do."""
