#!/bin/bash
# mpidp training that survives preemption: on SLURM, PBS, or anywhere.
#
# The scheduler signals this batch shell ahead of the end (--signal=B:USR1@90:
# SIGUSR1 90 s before the time limit; a preemption sends SIGTERM, then SIGKILL
# after KillWait, 30 s by default). The trap below passes the signal to the
# launcher, which passes it to every rank (srun and MPICH's mpiexec forward
# SIGUSR1 and SIGTERM; Hydra's mpiexec dies of SIGUSR2). mpidp.Checkpointer
# stops every rank at the same step, saves, and the job exits with status 75.
# Then this script requeues: `scontrol requeue` on SLURM, `qrerun` on PBS, and
# elsewhere (no scheduler, or REQUEUE=loop) it relaunches in place, up to
# MAX_RESTARTS times. The relaunch resumes from the last whole checkpoint.
#SBATCH --job-name=mpidp-preemptible
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=24
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@90          # to this shell, 90 s before the time limit
#SBATCH --requeue                   # may be requeued (scontrol requeue)
#SBATCH --open-mode=append          # a requeued run appends to the same log
#SBATCH --output=%x-%j.out
#PBS -N mpidp-preemptible
#PBS -l select=2:ncpus=48:mpiprocs=2:ompthreads=24
#PBS -l walltime=04:00:00
#PBS -r y
#PBS -j oe
#   add your site's partition/queue and account lines here
#
# Test it on any machine:  MPIDP_DRY_RUN=1 bash jobscripts/preemptible.sh [example arguments]
# (then `kill -USR1 <this shell's pid>` to see a stop, a relaunch and a resume).
set -uo pipefail
cd "${PBS_O_WORKDIR:-${SLURM_SUBMIT_DIR:-.}}"

# Edit: activate the environment where mpidp is installed, e.g.
#   source "$HOME/venvs/mpidp/bin/activate"     or     module load python cray-mpich

PREEMPTED_STATUS=75                 # mpidp.preemption.EXIT_STATUS
MAX_RESTARTS=${MAX_RESTARTS:-3}     # relaunches in place, where nothing requeues the job
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
    LAUNCH=(srun --mpi="${SRUN_MPI:-pmi2}" --cpu-bind=cores --distribution=block:block)
    REQUEUE=${REQUEUE:-scontrol}
elif [[ -n "${PBS_JOBID:-}" ]]; then
    NRANKS=$(wc -l < "$PBS_NODEFILE")
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-24}
    LAUNCH=(mpiexec -n "$NRANKS" -ppn 2 -bind-to numa)
    REQUEUE=${REQUEUE:-qrerun}
else
    LAUNCH=(mpiexec -n "${NRANKS:-2}")
    REQUEUE=loop
fi
# Edit: your training script; it must keep its checkpoints in a directory that
# outlives the job (a shared filesystem), the same path at every launch.
EXAMPLE=(examples/train_preemptible.py --checkpoint-dir checkpoints/preemptible --steps 2000)

if [[ "${MPIDP_DRY_RUN:-0}" == 1 ]]; then
    LAUNCH=(mpiexec -n 2)
    REQUEUE=loop
    EXAMPLE=(examples/train_preemptible.py --checkpoint-dir "${CHECKPOINT_DIR:-checkpoints/dry-run}"
             --steps 40 --pace 0.05 "$@")  # the script's arguments go to the example
    echo "dry run: ${LAUNCH[*]} python ${EXAMPLE[*]}, relaunched in place after a stop"
fi

pid=""
signalled=0
forward() {  # the scheduler's signal: pass it on to the ranks, remember it
    signalled=1
    [[ -n "$pid" ]] && kill "-$1" "$pid" 2>/dev/null
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

for ((launch = 0; ; launch++)); do
    signalled=0
    "${LAUNCH[@]}" python "${EXAMPLE[@]}" &
    pid=$!
    # A trapped signal ends `wait` early: wait again until the launcher itself has ended.
    while :; do
        wait "$pid"
        status=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    pid=""
    echo "launch $launch ended with status $status"
    if [[ $status -ne $PREEMPTED_STATUS && $signalled -eq 0 ]]; then
        exit "$status"      # finished (0) or failed: nothing to resume
    fi
    case "$REQUEUE" in
        scontrol) scontrol requeue "$SLURM_JOB_ID"; exit 0 ;;
        qrerun) qrerun "$PBS_JOBID"; exit 0 ;;
        loop)
            if ((launch >= MAX_RESTARTS)); then
                echo "stopped $((launch + 1)) times; giving up (MAX_RESTARTS=$MAX_RESTARTS)"
                exit "$status"
            fi
            echo "relaunching: the run resumes from its last checkpoint" ;;
        *) echo "REQUEUE must be scontrol, qrerun or loop, got '$REQUEUE'"; exit 2 ;;
    esac
done
