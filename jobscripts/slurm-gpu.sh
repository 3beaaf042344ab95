#!/bin/bash
# mpidp on SLURM GPU nodes: one MPI rank per GPU.
#
# mpidp picks the GPU of each rank's local rank; the cores per task feed the
# data loader and the host-side work. The three numbers below follow the GPUs
# per node: for nodes of 2 GPUs, --ntasks-per-node=2 --gpus-per-node=2 and
# --cpus-per-task = cores per node / 2.
#SBATCH --job-name=mpidp-gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4         # = GPUs per node
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8           # = cores per node / GPUs per node
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
#   add your site's --partition / --account lines here
#
# Test it on any machine without SLURM:  MPIDP_DRY_RUN=1 bash jobscripts/slurm-gpu.sh
set -euo pipefail

# Edit: activate the environment where mpidp is installed, e.g.
#   source "$HOME/venvs/mpidp/bin/activate"     or     module load python cuda cray-mpich

export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
# SLURM 22.05 to 23.02 do not pass sbatch's --cpus-per-task on to srun: without this,
# --cpu-bind=cores would give each rank one core (SLURM reads SRUN_CPUS_PER_TASK).
export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}
# Cray MPICH: export MPICH_GPU_SUPPORT_ENABLED=1 for CUDA-aware communication.
# --gpu-bind=closest gives each task the GPU nearest its cores.
# srun starts the ranks through a PMI plugin that must match the MPI mpi4py was
# built against: pmi2 for MPICH, MVAPICH and Intel MPI (which also needs
# I_MPI_PMI_LIBRARY=<SLURM's libpmi2.so>, docs/install.md), pmix for Open MPI,
# cray_shasta on HPE Cray (`srun --mpi=list` shows what your site has). A mismatch
# shows as the doctor below failing its launch check on every rank.
SRUN_MPI=${SRUN_MPI:-pmi2}
# --kill-on-bad-exit=1: a rank that dies ends the job instead of leaving the others waiting.
LAUNCH=(srun --mpi="$SRUN_MPI" --cpu-bind=cores --gpu-bind=closest --kill-on-bad-exit=1)
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
