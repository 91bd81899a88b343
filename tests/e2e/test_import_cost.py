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
