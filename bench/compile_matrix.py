"""torch.compile with each of mpidp's training paths, against one process (issue 30).

    mpiexec -n 2 python bench/compile_matrix.py [--timed N] [KIND ...]   # default: all KINDS

For mpidp's DDP, its ZeroRedundancyOptimizer (stages 1 and 2, around the DDP),
mpidp.horovod's DistributedOptimizer (the model compiled), and torch's DDP and FSDP2
(``fully_shard`` per Linear and the root) over a group of the "mpidp" backend and over a gloo
group, under inductor with compiled autograd off and on, and aot_eager with it on: 3 SGD steps
of the suite's mlp on each rank's shard, the largest relative difference of the parameters from
one process training on the whole batch, and dynamo's graph breaks (torch's forms: over
"mpidp" against over gloo). The suite runs aot_eager forms (tests/mpi/check_ddp_edges.py,
check_backend_torch.py, check_backend_fsdp.py); inductor's first compile of a graph takes
seconds on CI's 2 cores, so its forms are run here. ``--timed N`` adds the median time of N
more steps of each form (rank 0's, the ranks started together).
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "mpi"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402
from _models import RANK, inputs, loss_of, max_rel_diff, mlp, reference_copy, shard  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import mpidp  # noqa: E402
import mpidp.horovod as hvd  # noqa: E402

KINDS = ("ddp", "zero-1", "zero-2", "horovod", "torch-ddp/mpidp", "torch-ddp/gloo",
         "fsdp2/mpidp", "fsdp2/gloo")
GROUPS = {}  # "mpidp", "gloo": groups of every rank, made in main()
TIMED = 0  # steps timed after the compared ones (--timed N)
COMPILERS = (("inductor", False), ("inductor", True), ("aot_eager", True))


def wrapped(kind: str, model):
    """(the wrapper to call, its optimizer) for one training path."""
    if kind.startswith("torch-ddp/"):
        ddp = TorchDDP(model, process_group=GROUPS[kind.split("/")[1]])
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.05)
    if kind.startswith("fsdp2/"):
        mesh = DeviceMesh.from_group(GROUPS[kind.split("/")[1]], "cpu")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.SGD(model.parameters(), lr=0.05)
    if kind == "horovod":
        hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters())
        return model, opt
    ddp = mpidp.DistributedDataParallel(model)
    if kind == "ddp":
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    else:
        opt = mpidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.05,
                                            stage=int(kind[-1]))
    return ddp, opt


def step_of(wrapper, backend: str, compiled_autograd: bool):
    """One training step: the model compiled (``torch.compile(wrapper)``), and its backward
    eager or, with ``compiled_autograd``, under ``torch._dynamo.compiled_autograd._enable``,
    which compiles the autograd graph (hooks included) whatever frame calls ``backward()``.
    (``config.compiled_autograd=True`` alone compiles a backward only where it runs inside a
    compiled frame; the wrappers' graph breaks leave it outside: no capture at all, over gloo
    as over "mpidp".) The captures are counted."""
    compiled = torch.compile(wrapper, backend=backend)

    def step(x, y):
        loss = loss_of("mlp", compiled(x), y)
        if compiled_autograd:
            with torch._dynamo.compiled_autograd._enable(torch.compile(backend=backend)):
                loss.backward()
        else:
            loss.backward()
    return step


def run(kind: str, backend: str, compiled_autograd: bool) -> str:
    # torch's DDP refuses compiled autograd with its C++ reducer ("please use python_reducer"),
    # and reads the mode when it is built
    mode = "python_reducer" if compiled_autograd else torch._dynamo.config.optimize_ddp
    with torch._dynamo.config.patch(optimize_ddp=mode):
        return _run(kind, backend, compiled_autograd)


def _run(kind: str, backend: str, compiled_autograd: bool) -> str:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = mlp()
    local = reference_copy(model)
    wrapper, opt = wrapped(kind, model)
    train_step = step_of(wrapper, backend, compiled_autograd)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05)
    start = time.perf_counter()
    for step in range(3):
        x, y = inputs("mlp", step)
        opt.zero_grad()
        train_step(shard(x), shard(y))
        opt.step()
    seconds = time.perf_counter() - start
    for step in range(3):
        x, y = inputs("mlp", step)
        local_opt.zero_grad()
        loss_of("mlp", local(x), y).backward()
        local_opt.step()
    breaks = sum(counters["graph_break"].values())
    captures = counters["compiled_autograd"]["captures"]  # backward graphs compiled autograd made
    if kind.startswith("fsdp2/"):  # DTensors: the whole parameters, gathered
        whole = reference_copy(local)
        with torch.no_grad():
            for mine, theirs in zip(whole.parameters(), model.parameters()):
                mine.copy_(theirs.full_tensor() if hasattr(theirs, "full_tensor") else theirs)
        model = whole
    diff = max_rel_diff(model, local)
    steady = ""
    if TIMED:  # after the comparison: these steps go on from it
        times = []
        for step in range(TIMED):
            x, y = inputs("mlp", step)
            opt.zero_grad()
            dist.barrier(GROUPS["gloo"])
            begin = time.perf_counter()
            train_step(shard(x), shard(y))
            opt.step()
            times.append(time.perf_counter() - begin)
        steady = f"  steady {statistics.median(times) * 1e3:.2f} ms/step (median of {TIMED})"
    return (f"{kind:16s} {backend:9s} compiled_autograd={int(compiled_autograd)}  vs one process "
            f"{diff:.2e}  graph breaks {breaks}  compiled-autograd captures "
            f"{captures}  ({seconds:.1f} s, 3 steps){steady}")


def main():
    mpidp.init_process_group("gloo")
    GROUPS.update(gloo=dist.group.WORLD, mpidp=dist.new_group(backend="mpidp"))
    args = sys.argv[1:]
    if "--timed" in args:  # --timed N: N more steps, timed, after the first 3
        at = args.index("--timed")
        globals()["TIMED"] = int(args[at + 1])
        del args[at:at + 2]
    kinds = args or KINDS
    # the forms without compiled autograd first: after a compiled-autograd run, torch counts 10
    # graph breaks where it counted 3 for torch's DDP without it (over gloo and "mpidp" alike)
    for backend, compiled_autograd in COMPILERS:
        for kind in kinds:
            try:
                line = run(kind, backend, compiled_autograd)
            except Exception as error:  # a failing form is a result too
                line = f"{kind:16s} {backend:9s} compiled_autograd={int(compiled_autograd)}  " \
                       f"FAILED {type(error).__name__}: {str(error)[:300]}"
            if RANK == 0:
                print(line, flush=True)


if __name__ == "__main__":
    main()
