"""torch.compile with each of mpidp's training paths, against one process (issue 30).

    mpiexec -n 2 python bench/compile_matrix.py

For mpidp's DDP, its ZeroRedundancyOptimizer (stages 1 and 2, around the DDP) and
mpidp.horovod's DistributedOptimizer (the model compiled), under inductor with compiled
autograd off and on, and aot_eager with it on: 3 SGD steps of the suite's mlp on each rank's
shard, the largest relative difference of the parameters from one process training on the
whole batch, and dynamo's graph breaks. The suite runs the aot_eager forms
(tests/mpi/check_ddp_edges.py); inductor's first compile of a graph takes seconds on CI's
2 cores, so its forms are run here. torch's DDP and FSDP2 over "mpidp" under compile are in
tests/mpi/check_backend_torch.py.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "mpi"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from _models import RANK, inputs, loss_of, max_rel_diff, mlp, reference_copy, shard  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import mpidp  # noqa: E402
import mpidp.horovod as hvd  # noqa: E402

KINDS = ("ddp", "zero-1", "zero-2", "horovod")
COMPILERS = (("inductor", False), ("inductor", True), ("aot_eager", True))


def wrapped(kind: str, model, backend: str):
    """(the compiled callable, its optimizer) for one training path."""
    if kind == "horovod":
        hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters())
        return torch.compile(model, backend=backend), opt
    ddp = mpidp.DistributedDataParallel(model)
    if kind == "ddp":
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    else:
        opt = mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.05,
                                            stage=int(kind[-1]))
    return torch.compile(ddp, backend=backend), opt


def run(kind: str, backend: str, compiled_autograd: bool) -> str:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = mlp()
    local = reference_copy(model)
    compiled, opt = wrapped(kind, model, backend)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05)
    start = time.perf_counter()
    with torch._dynamo.config.patch(compiled_autograd=compiled_autograd):
        for step in range(3):
            x, y = inputs("mlp", step)
            opt.zero_grad()
            loss_of("mlp", compiled(shard(x)), shard(y)).backward()
            opt.step()
    seconds = time.perf_counter() - start
    for step in range(3):
        x, y = inputs("mlp", step)
        local_opt.zero_grad()
        loss_of("mlp", local(x), y).backward()
        local_opt.step()
    breaks = sum(counters["graph_break"].values())
    return (f"{kind:8s} {backend:9s} compiled_autograd={int(compiled_autograd)}  vs one process "
            f"{max_rel_diff(model, local):.2e}  graph breaks {breaks}  ({seconds:.1f} s, 3 steps)")


def main():
    for kind in KINDS:
        for backend, compiled_autograd in COMPILERS:
            try:
                line = run(kind, backend, compiled_autograd)
            except Exception as error:  # a failing form is a result too
                line = f"{kind:8s} {backend:9s} compiled_autograd={int(compiled_autograd)}  " \
                       f"FAILED {type(error).__name__}: {str(error)[:300]}"
            if RANK == 0:
                print(line, flush=True)


if __name__ == "__main__":
    main()
