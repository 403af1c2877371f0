"""``python -m gridtrain.agent ARGS``: torch's elastic launcher (``torch.distributed.run ARGS``),
with its rendezvous store listening on loopback only when the whole job is on this machine.

torch's TCPStore server listens on every interface whatever ``--master_addr``
says. For a single-node job with a loopback ``--master_addr`` (what ``gridtrain
run`` passes for a local run) this binds the store's socket to that address
first and hands it to a multi-tenant TCPStore; torch's static rendezvous then
finds that server for the port and uses it instead of opening its own. Every
other case (several nodes, another address) is torchrun unchanged.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import run as torchrun

from gridtrain.launch import bind_loopback, is_loopback

_KEEP: list[object] = []  # the pre-bound store must outlive the rendezvous (a weak cache)


def bind_store_to_loopback(argv: list[str]) -> bool:
    """Host the agent's store on loopback if ``argv`` (torchrun's arguments) is a one-node run
    on a loopback address; returns whether it did."""
    args = torchrun.get_args_parser().parse_args(argv)
    local = str(args.nnodes) in ("1", "1:1") and args.rdzv_backend == "static"
    if args.standalone or not local or not is_loopback(args.master_addr):
        return False
    fd = bind_loopback(args.master_addr, args.master_port)
    _KEEP.append(
        dist.TCPStore(
            args.master_addr,
            args.master_port,
            None,
            True,
            timedelta(seconds=60),
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=fd,
        )
    )
    return True


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    bind_store_to_loopback(argv)
    torchrun.main(argv)


if __name__ == "__main__":
    main()
