"""manualpar: manual-parallelism research framework for PyTorch.

The strategy owns ranks, collectives and checkpoint IO; your module composes DDP, FSDP, tensor
parallel and sharded embedding tables itself in `setup(strategy)`.

The public API, by rule: this module carries the strategy, `ParallelModule`/`load_trained`, the
builders, meta init, the Trainer, the checkpoint functions and every error class, plus the
embedding names a model definition needs most; `manualpar.embeddings` carries the whole
embedding vocabulary (configs, collections, plans and placements, update rules, the planner,
the disk tier, raw ids); `manualpar.metrics` (also `mp.metrics`) the evaluation metrics, exact
over every rank; `manualpar.data` (also `mp.data`) the data readers (Criteo click logs, MovieLens
ratings); `manualpar.nn` (also `mp.nn`) dense layers of recommendation models (DCN-v2's
`CrossNet`); `manualpar.phase_times` (also `mp.phase_times`) the recorder of a step's time per
phase and the sharded step's phase names. Anything deeper is internal and may move between
releases.
"""

from manualpar import data, deprecated, metrics, nn, phase_times
from manualpar.builders import (
    clip_grad_norm_,
    ddp,
    fsdp,
    set_batch_size,
    sharded_grad_scaler,
    total_grad_norm,
    tp,
    zero_optimizer,
)
from manualpar.checkpoint import (
    MANIFEST,
    PendingSave,
    describe_checkpoint,
    full_tensors,
    latest_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    save_checkpoint_async,
)
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    EmbeddingPlan,
    HashIds,
    ManagedCollisions,
    SparseFeatures,
    shard_embeddings,
)
from manualpar.environment import ClusterEnvironment, detect_environment
from manualpar.errors import (
    BuilderError,
    CheckpointError,
    CheckpointMismatchError,
    ClusterEnvironmentError,
    CollectiveError,
    ConfigError,
    ConfigTypeError,
    DataError,
    DataFileError,
    EmbeddingInputError,
    ManualParError,
    MeshError,
    MetricError,
    MissingDependencyError,
    NonFiniteError,
    OutputPathError,
    PlanError,
    StorageError,
)
from manualpar.heap import MallocTuning, malloc_env, tune_malloc
from manualpar.loop import (
    BestCheckpoints,
    EarlyStopping,
    Predictions,
    ReadAhead,
    Trainer,
    TrainPipeline,
    check_finite,
    dataset_batches,
    predict,
    scoring_batches,
)
from manualpar.meta import empty_init, is_meta, materialize
from manualpar.module import ParallelModule, load_trained
from manualpar.seed import RNGState, capture_rng_state, restore_rng_state, seed_everything
from manualpar.strategy import DEFAULT_TIMEOUT, ManualParallelStrategy

__version__ = "0.2.0"

__all__ = [
    "DEFAULT_TIMEOUT",
    "MANIFEST",
    "BestCheckpoints",
    "BuilderError",
    "CheckpointError",
    "CheckpointMismatchError",
    "ClusterEnvironment",
    "ClusterEnvironmentError",
    "CollectiveError",
    "ConfigError",
    "ConfigTypeError",
    "DataError",
    "DataFileError",
    "EarlyStopping",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "EmbeddingInputError",
    "EmbeddingPlan",
    "HashIds",
    "MallocTuning",
    "ManagedCollisions",
    "ManualParError",
    "ManualParallelStrategy",
    "MeshError",
    "MetricError",
    "MissingDependencyError",
    "NonFiniteError",
    "OutputPathError",
    "ParallelModule",
    "PendingSave",
    "PlanError",
    "Predictions",
    "RNGState",
    "ReadAhead",
    "SparseFeatures",
    "StorageError",
    "TrainPipeline",
    "Trainer",
    "capture_rng_state",
    "check_finite",
    "clip_grad_norm_",
    "data",
    "dataset_batches",
    "ddp",
    "describe_checkpoint",
    "detect_environment",
    "empty_init",
    "fsdp",
    "full_tensors",
    "is_meta",
    "latest_checkpoint",
    "load_checkpoint",
    "load_trained",
    "malloc_env",
    "materialize",
    "metrics",
    "nn",
    "phase_times",
    "predict",
    "read_manifest",
    "restore_rng_state",
    "save_checkpoint",
    "save_checkpoint_async",
    "scoring_batches",
    "seed_everything",
    "set_batch_size",
    "shard_embeddings",
    "sharded_grad_scaler",
    "total_grad_norm",
    "tp",
    "tune_malloc",
    "zero_optimizer",
]


def __getattr__(name: str) -> object:
    """A name renamed in 0.3 (deprecated.py): a warning giving its new spelling, then it."""
    return globals()[deprecated.moved(__name__, name)[1]]
