#!/bin/bash
# mpidp on PBS Pro / Torque: one MPI rank per NUMA domain.
#
# select=2 nodes, each with 2 ranks (mpiprocs) of 24 threads (ompthreads):
# set mpiprocs to the NUMA domains per node and ompthreads to their cores.
#PBS -N mpidp-cpu
#PBS -l select=2:ncpus=48:mpiprocs=2:ompthreads=24
#PBS -l walltime=00:30:00
#PBS -j oe
#   add your site's queue (-q) and account (-A) lines here
#
# Test it on any machine without PBS:  MPIDP_DRY_RUN=1 bash jobscripts/pbs.sh
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"

# Edit: activate the environment where mpidp is installed, e.g.
#   source "$HOME/venvs/mpidp/bin/activate"     or     module load python mpich

# PBS lists one line per MPI process (select x mpiprocs) in PBS_NODEFILE.
if [[ -n "${PBS_NODEFILE:-}" ]]; then NRANKS=$(wc -l < "$PBS_NODEFILE"); else NRANKS=4; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-24}
# MPICH (Hydra) binding; with Open MPI use: mpiexec -n "$NRANKS" --map-by ppr:1:numa --bind-to numa
LAUNCH=(mpiexec -n "$NRANKS" -ppn 2 -bind-to numa)
EXAMPLE=(examples/train_digits.py --epochs 10)

if [[ "${MPIDP_DRY_RUN:-0}" == 1 ]]; then
    echo "dry run: on the cluster this runs: ${LAUNCH[*]} python -m mpidp doctor"
    LAUNCH=(mpiexec -n 2 -bind-to core)  # the local stand-in: 2 ranks, a core each
    # your own EXAMPLE runs as you wrote it; only the bundled example is cut short
    if [[ "${EXAMPLE[0]}" == examples/train_digits.py ]]; then EXAMPLE=(examples/train_digits.py --epochs 1); fi
fi

# The layout of the ranks, then checks of what would make the job fail (launch, binding,
# threads, versions, /dev/shm, the rendezvous address, settings, GPUs): on a problem it
# prints the fix and ends the job here, before training (docs/doctor.md).
"${LAUNCH[@]}" python -m mpidp doctor
"${LAUNCH[@]}" python "${EXAMPLE[@]}"
