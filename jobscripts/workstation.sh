#!/bin/bash
# mpidp on one machine: NRANKS ranks, each bound to its own block of cores.
#
#   bash jobscripts/workstation.sh            # 2 ranks
#   NRANKS=4 bash jobscripts/workstation.sh
# On a machine with several NUMA domains, use one rank per domain
# (`lscpu | grep -i numa`) and -bind-to numa instead of core blocks.
set -euo pipefail

# Edit: activate the environment where mpidp is installed, e.g.
#   source .venv/bin/activate

NRANKS=${NRANKS:-2}
CORES_PER_RANK=$(( $(nproc) / NRANKS ))
(( CORES_PER_RANK >= 1 )) || CORES_PER_RANK=1
export OMP_NUM_THREADS=$CORES_PER_RANK
# MPICH (Hydra): each rank gets CORES_PER_RANK cores of its own.
# Open MPI instead: mpiexec -n "$NRANKS" --map-by slot:PE=$CORES_PER_RANK --bind-to core
LAUNCH=(mpiexec -n "$NRANKS" -bind-to "core:$CORES_PER_RANK")
EXAMPLE=(examples/train_digits.py --epochs 10)

if [[ "${MPIDP_DRY_RUN:-0}" == 1 ]]; then
    echo "dry run: this runs: ${LAUNCH[*]} python -m mpidp doctor"
    # your own EXAMPLE runs as you wrote it; only the bundled example is cut short
    if [[ "${EXAMPLE[0]}" == examples/train_digits.py ]]; then EXAMPLE=(examples/train_digits.py --epochs 1); fi
fi

# The layout of the ranks, then checks of what would make the job fail (launch, binding,
# threads, versions, /dev/shm, the rendezvous address, settings, GPUs): on a problem it
# prints the fix and ends the job here, before training (docs/doctor.md).
"${LAUNCH[@]}" python -m mpidp doctor
"${LAUNCH[@]}" python "${EXAMPLE[@]}"
