#!/bin/bash
# mpidp on SLURM CPU nodes: one MPI rank per NUMA domain, its cores for torch's threads.
#
# Find your node's layout with `lscpu | grep -i numa`: a node with 2 NUMA
# domains of 24 cores each wants --ntasks-per-node=2 --cpus-per-task=24.
#SBATCH --job-name=mpidp-cpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2         # = NUMA domains per node
#SBATCH --cpus-per-task=24          # = cores per NUMA domain
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
#   add your site's --partition / --account lines here
#
# Test it on any machine without SLURM:  MPIDP_DRY_RUN=1 bash jobscripts/slurm-cpu.sh
set -euo pipefail

# Edit: activate the environment where mpidp is installed, e.g.
#   source "$HOME/venvs/mpidp/bin/activate"     or     module load python cray-mpich

# One torch thread per core the rank owns (mpidp does the same when it is unset).
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
# SLURM 22.05 to 23.02 do not pass sbatch's --cpus-per-task on to srun: without this,
# --cpu-bind=cores would give each rank one core (SLURM reads SRUN_CPUS_PER_TASK).
export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}
# Each task gets a block of cpus-per-task cores; block:block keeps a task's
# cores inside one socket/NUMA domain.
# srun starts the ranks through a PMI plugin that must match the MPI mpi4py was
# built against: pmi2 for MPICH, MVAPICH and Intel MPI (which also needs
# I_MPI_PMI_LIBRARY=<SLURM's libpmi2.so>, docs/install.md), pmix for Open MPI,
# cray_shasta on HPE Cray (`srun --mpi=list` shows what your site has). A mismatch
# shows as the doctor below failing its launch check on every rank.
SRUN_MPI=${SRUN_MPI:-pmi2}
# --kill-on-bad-exit=1: a rank that dies ends the job instead of leaving the others waiting.
LAUNCH=(srun --mpi="$SRUN_MPI" --cpu-bind=cores --distribution=block:block --kill-on-bad-exit=1)
#   MPICH's own launcher instead:   mpiexec -n "$SLURM_NTASKS" -ppn 2 -bind-to numa
#   Open MPI's launcher instead:    mpiexec -n "$SLURM_NTASKS" --map-by ppr:1:numa --bind-to numa
# Edit: your training script and its arguments.
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
