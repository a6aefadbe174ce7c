# Call 2 ('bash .whl/resume.sh'): the second stop, by timeout's SIGUSR1 after 45 s
mkdir -p $OUT/r; export HPCAI_GIT_COMMIT=ad842e5 PYTHONUNBUFFERED=1
A="--cell-scale 100 --lr 2e-4 --lr-decay step --validate-bn standing --keep 0"
W=/tmp/hpcai-gpu; export PATH=$W/bin:$W/mpich/bin:$PATH PYTHONPATH=$W/site:$W/pkg
ls $W/runs/seed3/checkpoints | tail -3
cd $OUT/r && timeout -s USR1 45 hpcai-launch -N 2 -- train 3dgan --generate 1024 --seed 3 --epochs 80 --max-steps 16 --batch-size 16 --validate-every 1 --validate-events 512 --validate-draws 2 --eval-samples 0 --out $W/runs/seed3 --device cuda $A --resume < /dev/null > $OUT/r/resume.log 2>&1
echo "resume rc=$?"; cat $OUT/r/resume.log | cut -c1-400
cp $W/runs/seed3/physics.json $OUT/r/seed3-physics.json; cp $W/runs/seed3/epochs.jsonl $OUT/r/seed3-epochs.jsonl; cp $W/runs/seed3/steps.jsonl $OUT/r/seed3-steps.jsonl; ls $W/runs/seed3/checkpoints | tail -3
