"""`import manualpar` stays cheap: the heavy parts of torch load only where they are used.

torch.compile's machinery, DTensor, FSDP and the distributed checkpoint each cost a torchrun
worker or a test process 0.3-1 s of CPU to import (docs/benchmarks.md, "Import time"). This
checks which modules a fresh interpreter holds after the import, not how long it took.
"""

from __future__ import annotations

import json
import subprocess
import sys

from support.launch import clean_env

HEAVY = (
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.optim",
    "tensorboard",  # an optional extra: imported only by Trainer(tensorboard=True)
    "torch.utils.tensorboard",
)
PROBE = (
    "import json, sys\n"
    "import manualpar, manualpar.embeddings, manualpar.loop, manualpar.cli\n"
    f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
)


def test_import_manualpar_leaves_the_heavy_torch_modules_unloaded() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


SHARD_PROBE = (
    "import sys\n"
    "import manualpar as mp\n"
    "import torch\n"
    "from manualpar.embeddings import (EmbeddingBagCollection, EmbeddingBagConfig,\n"
    "    RowWiseAdagrad, SparseFeatures, shard_embeddings)\n"
    "tables = [EmbeddingBagConfig(f't{i}', 100, 8) for i in range(2)]\n"
    "with mp.empty_init():\n"
    "    ebc = EmbeddingBagCollection(tables)\n"
    "emb = shard_embeddings(ebc, mp.ManualParallelStrategy(), rule=RowWiseAdagrad(lr=0.1))\n"
    "print('torch._dynamo' in sys.modules)\n"
    "ids = SparseFeatures(('t0', 't1'), torch.tensor([1, 2, 3]), torch.tensor([1, 0, 2, 0]))\n"
    "for _ in range(2):\n"
    "    emb(ids).values.sum().backward()\n"
    "    emb.fused_optimizer.step()\n"
    "print('torch._dynamo' in sys.modules)\n"
)


def test_shard_embeddings_does_not_import_the_compiler() -> None:
    """The fused optimizer is a torch Optimizer, whose add_param_group imports torch._dynamo at
    its first call (about 0.5 s of every rank's init): shard_embeddings must not pay it, nor
    the first steps (the step's `eager_only` functions: 1.2 s of CPU at the first step)."""
    done = subprocess.run(
        [sys.executable, "-c", SHARD_PROBE],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert done.stdout.strip().splitlines()[-2:] == ["False", "False"]
