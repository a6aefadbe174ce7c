"""An unmodified torch.distributed ``env://`` script (the one of tests/test_mpi_launch.py),
which also writes where its rendezvous pointed.

Each rank writes ``out-RANK`` beside this file: world size, the allreduced sum of
``rank + 1``, LOCAL_RANK, MASTER_ADDR, the address MASTER_ADDR resolves to, the host name.
"""
import os
import socket

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
addr = os.environ["MASTER_ADDR"]
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"out-{dist.get_rank()}"),
          "w") as f:
    f.write(f"{dist.get_world_size()} {t.item()} {os.environ['LOCAL_RANK']} {addr} "
            f"{socket.gethostbyname(addr)} {socket.gethostname()}")
dist.destroy_process_group()
