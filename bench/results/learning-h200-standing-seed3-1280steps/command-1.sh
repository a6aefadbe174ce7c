# Call 1, from the checkout root on the H200, fed to 'bash /dev/stdin' as a here-document. The
# programs that gpu_learning.sh started read the rest of that stdin, so nothing after its line
# ran (no 'learning rc=', no resume): calls 2 and 3 did that part, from files.
mkdir -p $OUT/r; export HPCAI_GIT_COMMIT=ad842e5 PYTHONUNBUFFERED=1; set -o pipefail
A="--cell-scale 100 --lr 2e-4 --lr-decay step --validate-bn standing --keep 0"
TA=""; for a in $A; do TA="$TA --train-arg=$a"; done
bash bench/gpu_learning.sh $OUT/r 290 --seeds 3 --epochs 80 --max-steps 16 --batch-size 16 --validate-events 512 --validate-draws 2 --json $OUT/r/learning.json $TA 2>&1 | tee $OUT/r/log.txt
echo "learning rc=$?"
W=/tmp/hpcai-gpu; export PATH=$W/bin:$W/mpich/bin:$PATH PYTHONPATH=$W/site:$W/pkg
cd $OUT/r && timeout -s USR1 70 hpcai-launch -N 2 -- train 3dgan --generate 1024 --seed 3 --epochs 80 --max-steps 16 --batch-size 16 --validate-every 1 --validate-events 512 --validate-draws 2 --eval-samples 0 --out $W/runs/seed3 --device cuda $A --resume 2>&1 | tee $OUT/r/resume.log
echo "resume rc=$?"
cp $W/runs/seed3/physics.json $OUT/r/seed3-physics.json; cp $W/runs/seed3/epochs.jsonl $OUT/r/seed3-epochs.jsonl; ls -la $W/runs/seed3 $W/runs/seed3/checkpoints | tail -8
