import os

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter, which must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Under pytest-xdist (`-n N`) the workers share the cores: one process with several threads each would
# oversubscribe them, which on small ops costs far more than it gains.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


@pytest.fixture
def device():
    return DEVICE
