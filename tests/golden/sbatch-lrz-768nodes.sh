#!/bin/bash
#SBATCH --account=pn68xi
#SBATCH --cpus-per-task=24
#SBATCH --job-name=hpcai
#SBATCH --nodes=768
#SBATCH --ntasks-per-node=4
#SBATCH --output=hpcai-%j.out
#SBATCH --partition=general
#SBATCH --signal=USR1@120
#SBATCH --time=00:30:00

# Written by hpcai-launch sbatch. On the warning signal every rank checkpoints
# and exits 75; submit this script again to resume.
set -euo pipefail
export FI_PROVIDER=psm2
export I_MPI_FABRICS=shm:ofi
export PSM2_MULTI_EP=1

# hpcai-launch plans the ranks' step once, here on the batch host; every rank of this
# step (and only of this step) starts from that plan (HPCAI_PLAN). A planning error ends
# the job here, before srun.
step=(srun --mpi=pmi2 --nodes=768 --ntasks-per-node=4 --cpus-per-task=24 --cpu-bind=cores --kill-on-bad-exit=1 hpcai-launch --ranks-per-node 4 --threads-per-rank 12 --mpi intel --container /hppfs/work/images/hpcai-bookworm --runtime charliecloud --site /lrz/sys/hpcai/lrz.toml -- train 3dgan --data /hppfs/work/ecal --epochs 2 --batch-size 16 --out /hppfs/work/run1 --resume)
plan=$(hpcai-launch plan-step -- "${step[@]}")
HPCAI_PLAN=$plan "${step[@]}"
