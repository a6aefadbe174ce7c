#!/bin/bash
# seeds 3, 2, 1: the step schedule of learning-vm-scale100-b16-lr2e-4-step-1280steps, judged
# with --validate-bn standing (the training is the same bit for bit), from the checkout root.
# As run on the VM, except that there the checkout root and its venv were named by absolute
# path; the work directory and the JSON are outside the checkout.
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
export USER=root PATH=$PWD/.venv/bin:$PATH
exec nice -n 10 .venv/bin/python bench/learning.py --seeds 3,2,1 --epochs 80 --max-steps 16 --batch-size 16 \
  --validate-events 512 --validate-draws 2 --workdir /tmp/learnS/run \
  --json /tmp/learnS/learning.json --timeout 40000 \
  --train-arg=--cell-scale --train-arg=100 --train-arg=--lr --train-arg=2e-4 \
  --train-arg=--lr-decay --train-arg=step --train-arg=--validate-bn --train-arg=standing \
  --train-arg=--stall-timeout --train-arg=3600 --train-arg=--keep --train-arg=0 --train-arg=--resume
