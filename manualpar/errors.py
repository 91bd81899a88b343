"""Exception types raised by manualpar.

Each one subclasses the built-in type a caller would naturally catch (ValueError, TypeError,
RuntimeError, OSError, ImportError), so code written against plain torch keeps working, while
tests and users can match the precise failure.

How a raise picks its class: the domain's class where one fits (a checkpoint, a plan, a mesh, a
sparse batch, a data file, a builder, a metric, the launcher's environment); otherwise
ConfigError for a value manualpar cannot take (an argument, a setting, what a model's hook
returned) and ConfigTypeError for one of the wrong kind; MissingDependencyError for an optional
package that is not installed. What stays a bare built-in is not an error manualpar reports:
protocol signals (StopIteration ending a data function, NotImplementedError of an abstract method
or of an op a tensor subclass does not support), exceptions raised and caught inside one
function, and internal invariants. tests/unit/test_errors_typed.py guards this.
"""

from __future__ import annotations


class ManualParError(Exception):
    """Base class of every error manualpar raises on purpose."""


class ClusterEnvironmentError(ManualParError, ValueError):
    """The rank/world variables of the launcher are missing or contradict each other, or do not fit
    what the process finds (an adopted group of other ranks, more local ranks than GPUs)."""


class CollectiveError(ManualParError, RuntimeError):
    """A collective failed or timed out; the message names the operation and this rank."""


class DataError(ManualParError, ValueError):
    """A rank's data is not what the loop can take: a batch of None (the loop's "no batch"),
    raised on every rank at the same step naming the rank and the batch index; another rank's
    loader that raised; batch sizes that do not fit the dataset or the world size; a bad data file
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
    optimizer created before setup, a submodule that cannot be initialized, materialize() asked
    for the meta device or unknown submodules."""


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
    name that does not exist, a node layout other than the launcher's, a 2-D mesh given to a
    collective that takes one dim."""


class StorageError(ManualParError, OSError):
    """Rows on disk are not what the disk tier wrote: a row file shorter than its table block,
    or one that another process changed, or a row the OS could not read or write (errno kept).
    The message names the table, rank and file."""


class OutputPathError(ManualParError, OSError):
    """A Trainer output cannot be written where it goes (the TensorBoard log directory is a
    file or read-only). The message names the path and what to do."""


class ConfigError(ManualParError, ValueError):
    """A value manualpar cannot take, where no domain class fits: an argument out of its range or
    choices (Trainer(precision=...), reduce(op=...), a timeout of 0 s), settings that contradict
    each other, an input of a shape the call does not take, or what a model's hook returned
    (training_step without a loss, configure_optimizers with unknown keys)."""


class ConfigTypeError(ManualParError, TypeError):
    """ConfigError's TypeError twin: an argument, model or hook result of the wrong kind (a model
    without predict_step, Trainer(early_stopping=...) given something else), so `except
    TypeError` keeps catching it."""


class MetricError(ManualParError, ValueError):
    """A metric cannot take its inputs or give a value: lengths that differ, labels not 0/1,
    probabilities outside [0, 1], ranks below 1, a compute with no sample on any rank (or one
    class for AUC), or validation metrics that clash or are not held on the model."""


class MissingDependencyError(ManualParError, ImportError):
    """An optional package a feature needs is not installed (or fails to import); the message
    names the feature and the pip command."""
