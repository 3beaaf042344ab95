#!/usr/bin/env bash
# GPU validation: the GPU tests and the GPU benchmarks, one log per part in OUTDIR.
#
#     bash bench/gpu_validate.sh OUTDIR [sanity|tests|path|nccl|allreduce|bench|others|profile|suite]...
#                                                                       (default: tests bench)
#
# Needs a CUDA GPU, torch with CUDA and CuPy in python3. A venv that sees them is
# made in /tmp/mpidp-gpu-venv; mpi4py (and an MPI wheel, if any) come from wheels in .whl/
# (there is no package index on the GPU machines of this project), else python3's own
# mpi4py and the mpiexec on PATH. MPI_PREFIX=DIR takes the MPI installed in DIR instead (the
# CUDA-aware MPICH of bench/build_cuda_mpi.sh, carried as build/cuda-mpi): its bin/ on PATH,
# MPI4PY_LIBMPI its libmpi, its own venv (/tmp/mpidp-gpu-venv-mpi) with the mpi4py wheel
# built against it where one fits this python (DIR/wheels/). The whole run stops after
# LIMIT seconds (default 540: a 600-second call leaves time to fetch the logs).
#   sanity: which MPI, whether it reports CUDA, mpidp's decision at 2 ranks;
#   tests: the kernel and CUDA unit tests, tests/mpi/check_gpu.py and check_syncbn.py
#          under mpiexec (MPIDP_TEST_GPU=1: a GPU test that would skip fails), as decided
#          and with host staging forced (MPIDP_CUDA_AWARE=0);
#   path: the path test (tests/mpi/check_gpu.py's device-path tests and its GPU-vs-CPU
#          comparison of DDP under every overlap strategy, with the collectives and the backend's
#          progress thread) with MPIDP_TEST_PATH=PATH (default pointer: every device collective
#          must hand MPI the device pointer), then again with MPIDP_CUDA_AWARE=0, where it must
#          fail (a fall back to staging is caught); then the whole of check_gpu.py, staged, must pass;
#   nccl: tests/mpi/gpu_default_backend.py at 1 rank (NCCL) and 2 ranks on one GPU ("mpidp");
#   allreduce: bench/gpu_allreduce.py (CUDA-aware against staged, 1 MiB - 256 MiB);
#   bench: bench/kernel_bench.py, and bench/train_bench.py --device cuda at 2 ranks
#          on one GPU (mpidp vs torch's DDP over the mpidp backend and over gloo; MODELS and
#          MODES change the models and modes), as decided and (CUDA-aware libraries) staged;
#   others: the check files with GPU parts beyond check_gpu (horovod, rendezvous, shm), as
#          decided and staged (the test that starts its own mpiexec is left out: GPU machines
#          have no ssh agent for a nested Open MPI launch);
#   doctor: python -m mpidp doctor at 1 rank (must pass), 2 ranks on one GPU and 2 ranks of
#          which one sees no GPU (both must fail, naming it);
#   store: bench/store_startup.py with NCCL at 1 and 2 ranks, the store over MPI and over TCP;
#   profile: bench/gpu_profile.py on mlp (mpidp and torch's DDP over the mpidp backend);
#   horovod: Horovod 0.28.1's own suite (tests/test_horovod_suite.py; HOROVOD_SUITE: a copy of
#          ../shared/horovod-0.28.1 carried along) with its CUDA dtypes and GPU tests, and
#          Horovod's two PyTorch examples on the GPU: at 1 rank as decided and staged; with
#          MPICH also at 2 ranks on the one GPU, each rank a node of its own
#          (MPIR_CVAR_NUM_CLIQUES=2: the suite puts rank r on GPU hvd.local_rank());
#          HVD_RANKS: other rank counts (MPICH: each rank its own node); HVD_LIST=1: first list
#          every failure at each count (bench/horovod_suite_failures.sh); HVD_STAGED="": no
#          pass/fail run; HVD_EXAMPLES=0: not the examples;
#   suite: the whole test suite with the GPU visible.
set -uo pipefail
if [ -z "${GPU_VALIDATE_LIMITED:-}" ]; then  # one time limit for the whole run
    GPU_VALIDATE_LIMITED=1 exec timeout --kill-after=10 "${LIMIT:-540}" bash "$0" "$@"
fi
out=${1:?usage: gpu_validate.sh OUTDIR [tests|path|bench|profile|suite]...}
shift
parts=${*:-tests bench}
mkdir -p "$out"
cd "$(dirname "$0")/.."
venv=/tmp/mpidp-gpu-venv${MPI_PREFIX:+-mpi}
if [ ! -x $venv/bin/python ]; then
    python3 -m venv $venv  # python3 may itself be a venv's: its packages come in by a .pth
    python3 -c "import site; print('\n'.join(site.getsitepackages()))" \
        > "$($venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/base.pth"
    if ls .whl/*.whl >/dev/null 2>&1; then
        $venv/bin/pip install -q --no-index --no-deps .whl/*.whl || exit 1
    fi
    $venv/bin/pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
    if [ -n "${MPI_PREFIX:-}" ] && ls "$MPI_PREFIX"/wheels/mpi4py-*.whl >/dev/null 2>&1; then
        # built against MPI_PREFIX's MPI; pip refuses it where this python's tag differs
        $venv/bin/pip install -q --no-index --no-deps --force-reinstall "$MPI_PREFIX"/wheels/mpi4py-*.whl \
            || echo "the mpi4py wheel of $MPI_PREFIX does not fit this python: mpi4py's own, on MPI4PY_LIBMPI"
    fi
fi
py=$venv/bin/python
if [ -n "${MPI_PREFIX:-}" ]; then
    MPI_PREFIX=$(realpath "$MPI_PREFIX")
    export PATH=$MPI_PREFIX/bin:$PATH LD_LIBRARY_PATH=$MPI_PREFIX/lib:${LD_LIBRARY_PATH:-}
    export OPAL_PREFIX=$MPI_PREFIX MPI4PY_LIBMPI=$MPI_PREFIX/lib/libmpi.so
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export MPIEXEC=$MPI_PREFIX/bin/mpiexec  # not the wheel's beside the venv's python
fi
launcher=$($py -c "import sys; sys.path.insert(0, 'tests'); import launch; print(launch.mpiexec())")
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MPIDP_TEST_GPU=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $py - <<'EOF'
import sys, torch, mpi4py
from mpi4py import MPI
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count(), "mpi4py", mpi4py.__version__)
print("MPI:", MPI.Get_library_version().splitlines()[0])
try:
    import cupy; print("cupy", cupy.__version__)
except ImportError as err:
    print("no cupy:", err)
import mpidp.cuda
print("library reports CUDA:", mpidp.cuda.library_reports_cuda())
print("decision:", mpidp.cuda.decision())
EOF
    echo "mpiexec: $launcher"
} 2>&1 | tee "$out/env.txt"

for part in $parts; do
case $part in
tests)
    timeout 300 $py -m pytest -q -p no:cacheprovider -rs tests/test_kernels.py tests/test_cuda.py \
        2>&1 | tee "$out/tests_kernels.txt"
    timeout ${T:-300} $launcher -n 2 $py -m pytest -q -p no:cacheprovider -rs -s tests/mpi/check_gpu.py \
        2>&1 | tee "$out/tests_check_gpu.txt"
    timeout ${T:-300} $launcher -n 2 $py -m pytest -q -p no:cacheprovider -rs -s tests/mpi/check_syncbn.py \
        -k cuda 2>&1 | tee "$out/tests_syncbn.txt"
    # host staging forced, whatever the library says (the same answers, through host memory)
    MPIDP_CUDA_AWARE=0 timeout ${T:-300} $launcher -n 2 $py -m pytest -q -p no:cacheprovider -rs -s \
        tests/mpi/check_gpu.py 2>&1 | tee "$out/tests_check_gpu_staged.txt"
    MPIDP_CUDA_AWARE=0 timeout ${T:-300} $launcher -n 2 $py -m pytest -q -p no:cacheprovider -rs -s \
        tests/mpi/check_syncbn.py -k cuda 2>&1 | tee "$out/tests_syncbn_staged.txt"
    ;;
path)
    want=${TEST_PATH:-pointer}
    tests="path or decided or matches_the_cpu"
    echo "== MPIDP_TEST_PATH=$want, as decided: must pass" | tee "$out/path.txt"
    MPIDP_TEST_PATH=$want timeout ${T:-240} $launcher -n 2 $py -m pytest -q -p no:cacheprovider \
        -rs tests/mpi/check_gpu.py -k "$tests" 2>&1 | tee -a "$out/path.txt"
    echo "rc ${PIPESTATUS[0]} (must be 0)" | tee -a "$out/path.txt"
    echo "== MPIDP_TEST_PATH=$want, MPIDP_CUDA_AWARE=0: must fail" | tee -a "$out/path.txt"
    MPIDP_TEST_PATH=$want MPIDP_CUDA_AWARE=0 timeout ${T:-240} $launcher -n 2 $py -m pytest -q \
        -p no:cacheprovider -rs tests/mpi/check_gpu.py -k "$tests" 2>&1 | tee -a "$out/path.txt"
    echo "rc ${PIPESTATUS[0]} (must not be 0)" | tee -a "$out/path.txt"
    echo "== MPIDP_TEST_PATH=staged, MPIDP_CUDA_AWARE=0: the whole file must pass" | tee -a "$out/path.txt"
    MPIDP_TEST_PATH=staged MPIDP_CUDA_AWARE=0 timeout ${T:-240} $launcher -n 2 $py -m pytest -q \
        -p no:cacheprovider -rs tests/mpi/check_gpu.py 2>&1 | tee -a "$out/path.txt"
    echo "rc ${PIPESTATUS[0]} (must be 0)" | tee -a "$out/path.txt"
    ;;
sanity)
    for n in 1 2; do
        timeout 120 $launcher -n $n $py -c "import mpidp, mpidp.cuda as c; from mpi4py import MPI; print(MPI.COMM_WORLD.rank, MPI.Get_library_version().splitlines()[0], c.library_reports_cuda(), c.decision(), flush=True)" 2>&1 | tee -a "$out/sanity.txt"
    done
    ;;
nccl)
    for n in 1 2; do
        timeout 120 $launcher -n $n $py tests/mpi/gpu_default_backend.py 2>&1 | tee -a "$out/nccl.txt"
        echo "ranks $n rc ${PIPESTATUS[0]}" | tee -a "$out/nccl.txt"
    done
    ;;
allreduce)
    timeout 300 $launcher -n 2 $py bench/gpu_allreduce.py --out "$out/allreduce.jsonl" \
        2>&1 | tee "$out/bench_allreduce.txt"
    ;;
others)
    for staged in unset 0; do
        echo "== MPIDP_CUDA_AWARE=$staged" | tee -a "$out/tests_others.txt"
        env $( [ "$staged" = 0 ] && echo MPIDP_CUDA_AWARE=0 ) timeout ${T:-300} $launcher -n 2 \
            $py -m pytest -q -p no:cacheprovider -rs tests/mpi/check_horovod.py \
            tests/mpi/check_rendezvous.py tests/mpi/check_shm.py -k "not torchrun_style" \
            2>&1 | tee -a "$out/tests_others.txt"
    done
    ;;
doctor)
    for case in "-n 1 $py -m mpidp doctor" "-n 2 $py -m mpidp doctor" \
                "-n 1 $py -m mpidp doctor : -n 1 env CUDA_VISIBLE_DEVICES= $py -m mpidp doctor"; do
        echo "== mpiexec $case" | tee -a "$out/doctor.txt"
        timeout 120 $launcher $case 2>&1 | tee -a "$out/doctor.txt"
        echo "rc ${PIPESTATUS[0]}" | tee -a "$out/doctor.txt"
    done
    ;;
store)
    timeout ${T:-300} $py bench/store_startup.py --ranks 1 2 --launches ${LAUNCHES:-3} --backends nccl \
        2>&1 | tee "$out/store_startup.txt"
    ;;
bench)
    timeout 300 $py bench/kernel_bench.py --out "$out/kernel.jsonl" 2>&1 | tee "$out/bench_kernel.txt"
    aware=$($py -c "import mpidp.cuda as c; print(int(bool(c.library_reports_cuda())))")
    for model in ${MODELS:-mlp cnn transformer}; do
        for staged in $( [ "$aware" = 1 ] && echo "unset 0" || echo unset); do
            echo "== $model, MPIDP_CUDA_AWARE=$staged" | tee -a "$out/bench_train.txt"
            env $( [ "$staged" = 0 ] && echo MPIDP_CUDA_AWARE=0 ) timeout ${T:-300} $launcher -n 2 \
                $py bench/train_bench.py --device cuda --model $model \
                --modes ${MODES:-local mpidp ddp-mpidp ddp-gloo} --steps ${STEPS:-20} \
                --out "$out/train.jsonl" 2>&1 | tee -a "$out/bench_train.txt"
        done
    done
    ;;
horovod)
    suite=$(realpath "${HOROVOD_SUITE:-../shared/horovod-0.28.1}")
    shim="PYTHONPATH=$PWD/tests/horovod_shim:${PYTHONPATH:-} PYTHONDONTWRITEBYTECODE=1"
    sizes=1; $launcher --version 2>&1 | grep -qi hydra && sizes="1 2"
    for ranks in ${HVD_RANKS:-$sizes}; do
        if [ -n "${HVD_LIST:-}" ]; then  # every failure, listed (bench/horovod_suite_failures.sh)
            # at 3 ranks no float16 output can pass the three float16 prescale tests
            # (docs/horovod-tests.md): deselected there, to count the others
            f16=; [ "$ranks" = 3 ] && f16=test_horovod_allreduce_prescale,test_horovod_reducescatter_prescale,test_horovod_grouped_reducescatter_prescale
            env HOROVOD_SUITE="$suite" PY=$py MPIEXEC=$launcher RANKS=$ranks ROUNDS=${HVD_ROUNDS:-4} \
                HVD_DESELECT=$f16 \
                MPIR_CVAR_NUM_CLIQUES=$ranks T=${T:-600} \
                bash bench/horovod_suite_failures.sh "$out/list_$ranks" 2>&1 \
                | tee -a "$out/horovod_suite.txt"
        fi
        for staged in ${HVD_STAGED-unset 0}; do
            [ "$ranks" = 2 ] && [ "$staged" = 0 ] && continue  # the MPICH wheel stages anyway
            echo "== $ranks ranks, MPIDP_CUDA_AWARE=$staged" | tee -a "$out/horovod_suite.txt"
            env $( [ "$staged" = 0 ] && echo MPIDP_CUDA_AWARE=0 ) HOROVOD_SUITE="$suite" \
                HVD_SUITE_GPU_RANKS=$ranks MPIR_CVAR_NUM_CLIQUES=$ranks timeout ${T:-600} \
                $py -m pytest -q -p no:cacheprovider -rs --basetemp "$out/suite_${ranks}_$staged" \
                tests/test_horovod_suite.py -k gpu 2>&1 | tee -a "$out/horovod_suite.txt"
        done
        [ "${HVD_EXAMPLES:-1}" = 0 ] && continue
        echo "== examples at $ranks ranks" | tee -a "$out/horovod_examples.txt"
        home=$(mktemp -d)
        env $shim HOME=$home MPIR_CVAR_NUM_CLIQUES=$ranks timeout 300 $launcher -n $ranks \
            $py "$suite/examples/pytorch/pytorch_mnist.py" --epochs 2 --batch-size 32 --lr 0.05 \
            --log-interval 100 --data-dir $home 2>&1 | tee -a "$out/horovod_examples.txt"
        env $shim MPIR_CVAR_NUM_CLIQUES=$ranks timeout 300 $launcher -n $ranks \
            $py "$suite/examples/pytorch/pytorch_synthetic_benchmark.py" --batch-size 32 \
            --num-iters 3 2>&1 | tee -a "$out/horovod_examples.txt"
    done
    ;;
profile)
    timeout 300 $launcher -n 2 $py bench/gpu_profile.py --model mlp --out "$out" \
        2>&1 | tee "$out/profile.txt"
    ;;
suite)
    timeout 580 $py -m pytest -q -p no:cacheprovider -x 2>&1 | tee "$out/suite.txt"
    ;;
esac
done
