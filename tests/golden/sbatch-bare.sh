#!/bin/bash
#SBATCH --account=pn68xi
#SBATCH --cpus-per-task=12
#SBATCH --job-name=hpcai
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=2
#SBATCH --output=hpcai-%j.out
#SBATCH --partition=general
#SBATCH --signal=USR1@120
#SBATCH --time=02:00:00

# Written by hpcai-launch sbatch. On the warning signal every rank checkpoints
# and exits 75; submit this script again to resume.
set -euo pipefail

# hpcai-launch plans the ranks' step once, here on the batch host; every rank of this
# step (and only of this step) starts from that plan (HPCAI_PLAN). A planning error ends
# the job here, before srun.
step=(srun --mpi=pmix --nodes=4 --ntasks-per-node=2 --cpus-per-task=12 --cpu-bind=cores --kill-on-bad-exit=1 hpcai-launch --ranks-per-node 2 --threads-per-rank 12 --mpi openmpi -- train 3dgan --data /hppfs/work/ecal --epochs 2 --batch-size 16 --out /hppfs/work/run1 --resume)
plan=$(hpcai-launch plan-step -- "${step[@]}")
HPCAI_PLAN=$plan "${step[@]}"
