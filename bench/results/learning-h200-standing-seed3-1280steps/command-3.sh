# Call 3 ('bash .whl/finish.sh'): resumed to the end
mkdir -p $OUT/r; export HPCAI_GIT_COMMIT=ad842e5 PYTHONUNBUFFERED=1
A="--cell-scale 100 --lr 2e-4 --lr-decay step --validate-bn standing --keep 0"
W=/tmp/hpcai-gpu; export PATH=$W/bin:$W/mpich/bin:$PATH PYTHONPATH=$W/site:$W/pkg
ls $W/runs/seed3/checkpoints | tail -3
cd $OUT/r && hpcai-launch -N 2 -- train 3dgan --generate 1024 --seed 3 --epochs 80 --max-steps 16 --batch-size 16 --validate-every 1 --validate-events 512 --validate-draws 2 --eval-samples 0 --out $W/runs/seed3 --device cuda $A --resume < /dev/null > $OUT/r/finish.log 2>&1
echo "rc=$?"; tail -c 3000 $OUT/r/finish.log
cp $W/runs/seed3/physics.json $OUT/r/seed3-physics.json; cp $W/runs/seed3/epochs.jsonl $OUT/r/seed3-epochs.jsonl; cp $W/runs/seed3/steps.jsonl $OUT/r/seed3-steps.jsonl; ls $W/runs/seed3/checkpoints | tail -3
c=$(ls $W/runs/seed3/checkpoints | tail -1); cp $W/runs/seed3/checkpoints/$c $OUT/r/; cp $W/runs/seed3/*.png $OUT/r/; ls -la $OUT/r
