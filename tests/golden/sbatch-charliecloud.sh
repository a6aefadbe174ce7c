#!/bin/bash
#SBATCH --cpus-per-task=12
#SBATCH --job-name=hpcai
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --output=hpcai-%j.out
#SBATCH --signal=USR1@120
#SBATCH --time=01:00:00

# Written by hpcai-launch sbatch. On the warning signal every rank checkpoints
# and exits 75; submit this script again to resume.
set -euo pipefail

# hpcai-launch plans the ranks' step once, here on the batch host; every rank of this
# step (and only of this step) starts from that plan (HPCAI_PLAN). A planning error ends
# the job here, before srun.
step=(srun --mpi=pmix --nodes=2 --ntasks-per-node=4 --cpus-per-task=12 --cpu-bind=cores --kill-on-bad-exit=1 hpcai-launch --ranks-per-node 4 --threads-per-rank 12 --mpi openmpi --container /scratch/images/hpcai-bookworm --runtime charliecloud --bind /hppfs/work -- train 3dgan --data /hppfs/work/ecal --epochs 2 --batch-size 16 --out /hppfs/work/run1 --resume)
plan=$(hpcai-launch plan-step -- "${step[@]}")
HPCAI_PLAN=$plan "${step[@]}"
