"""A plain Horovod user script (PyTorch, synthetic data), as sites bring them.

Written in the style of Horovod's own ``pytorch_synthetic_benchmark.py`` and knowing nothing
of hpcai: hvd.init, DistributedOptimizer, broadcast of the initial state, timed batches of
random images, img/sec per worker and in total. A small convolutional network stands in for
torchvision's models (torchvision does not import beside the CPU torch build used here).

Every worker also prints one line with what Horovod told it (rank, size, local rank, local
size) and a checksum of its final weights, so that a launcher test can check the world is
consistent and the replicas agree.
"""

import argparse
import socket
import timeit
import zlib

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark (Horovod)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--batch-size", type=int, default=8, help="input batch size")
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--num-warmup-batches", type=int, default=2)
parser.add_argument("--num-batches-per-iter", type=int, default=2)
parser.add_argument("--num-iters", type=int, default=3)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
args = parser.parse_args()

hvd.init()
torch.manual_seed(1234 + hvd.rank())   # different on purpose: the broadcast must fix it
torch.set_num_threads(max(1, torch.get_num_threads()))


class SmallConvNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


model = SmallConvNet()
lr_scaler = 1 if args.use_adasum else hvd.size()
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.randint(0, 10, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


log(f"Model: SmallConvNet, Batch size: {args.batch_size}, Number of CPUs: {hvd.size()}")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log(f"Iter #{x}: {img_sec:.1f} img/sec per CPU")
    img_secs.append(img_sec)
img_sec_mean, img_sec_conf = np.mean(img_secs), 1.96 * np.std(img_secs)
log(f"Img/sec per CPU: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * img_sec_mean:.1f} "
    f"+-{hvd.size() * img_sec_conf:.1f}")

crc = 0
for p in model.parameters():
    crc = zlib.crc32(p.detach().numpy().tobytes(), crc)
print(f"horovod-worker rank={hvd.rank()} size={hvd.size()} local_rank={hvd.local_rank()} "
      f"local_size={hvd.local_size()} host={socket.gethostname()} weights_crc={crc:08x}",
      flush=True)
