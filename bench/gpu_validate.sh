#!/usr/bin/env bash
# GPU validation: the GPU tests and the GPU benchmarks, one log per part in OUTDIR.
#
#     bash bench/gpu_validate.sh OUTDIR [tests|bench|profile|suite]...   (default: tests bench)
#
# Needs a CUDA GPU, torch with CUDA and CuPy in python3. A venv that sees them is
# made in /tmp/mpidp-gpu-venv; an MPI comes from wheels in .whl/ if any (mpich,
# mpi4py: there is no package index on the GPU machines of this project), else
# from python3's own mpi4py and the mpiexec on PATH.
#   tests: the kernel and CUDA unit tests, tests/mpi/check_gpu.py and check_syncbn.py
#          under mpiexec (MPIDP_TEST_GPU=1: a GPU test that would skip fails);
#   bench: bench/kernel_bench.py, and bench/train_bench.py --device cuda at 2 ranks
#          on one GPU (mpidp vs torch's DDP over gloo and over the mpidp backend;
#          MODELS and MODES change the models and modes);
#   profile: bench/gpu_profile.py on mlp (mpidp and torch's DDP over the mpidp backend);
#   suite: the whole test suite with the GPU visible.
set -uo pipefail
out=${1:?usage: gpu_validate.sh OUTDIR [tests|bench|profile|suite]...}
shift
parts=${*:-tests bench}
mkdir -p "$out"
cd "$(dirname "$0")/.."
venv=/tmp/mpidp-gpu-venv
if [ ! -x $venv/bin/python ]; then
    python3 -m venv $venv  # python3 may itself be a venv's: its packages come in by a .pth
    python3 -c "import site; print('\n'.join(site.getsitepackages()))" \
        > "$($venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/base.pth"
    if ls .whl/*.whl >/dev/null 2>&1; then
        $venv/bin/pip install -q --no-index --no-deps .whl/*.whl || exit 1
    fi
    $venv/bin/pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi
py=$venv/bin/python
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
    timeout 300 $launcher -n 2 $py -m pytest -q -p no:cacheprovider -rs -s tests/mpi/check_gpu.py \
        2>&1 | tee "$out/tests_check_gpu.txt"
    timeout 300 $launcher -n 2 $py -m pytest -q -p no:cacheprovider -rs -s tests/mpi/check_syncbn.py \
        -k cuda 2>&1 | tee "$out/tests_syncbn.txt"
    # host staging forced, whatever the library says (the same answers, through host memory)
    MPIDP_CUDA_AWARE=0 timeout 300 $launcher -n 2 $py -m pytest -q -p no:cacheprovider -rs \
        tests/mpi/check_gpu.py 2>&1 | tee "$out/tests_check_gpu_staged.txt"
    ;;
bench)
    timeout 300 $py bench/kernel_bench.py --out "$out/kernel.jsonl" 2>&1 | tee "$out/bench_kernel.txt"
    for model in ${MODELS:-mlp cnn transformer}; do
        timeout 300 $launcher -n 2 $py bench/train_bench.py --device cuda --model $model \
            --modes ${MODES:-local mpidp ddp-mpidp ddp-gloo} --steps 20 --out "$out/train.jsonl" \
            2>&1 | tee -a "$out/bench_train.txt"
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
