"""Where float32 FSDP departs from one-process training: the batch split over the ranks.

    python benchmarks/fsdp_split_batch.py [--sequence 0]

A course's FSDP test, as its issue describes it: an Embedding and two Linear layers of their
own class (d_model 64, d_ff 128, vocabulary 100), SGD for 3 steps at p = 2 over gloo with
`torch.use_deterministic_algorithms(True)`, each rank on its half of a batch of 20, against
one process on the whole batch. Two ranks train it twice: wrapped in the reference's
FullyShardedDataParallel (`compute_dtype=None`), and bare, with data parallelism's
arithmetic (local gradients, summed over the ranks, divided by p). The script prints, per step
and parameter, whether each equals one-process training (`torch.equal`) and the largest
difference, and whether the two split runs equal each other; then, in one process alone, the
two halves' gradients added against the whole batch's.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from reference.fully_sharded import FullyShardedDataParallel

BATCH, VOCABULARY, WORLD_SIZE, STEPS = 20, 100, 2, 3
State = dict[str, Tensor]
#: After a backward: make the gradients the mean over ranks; return what reads the state.
Synchronize = Callable[[nn.Module], Callable[[], State]]


class Linear(nn.Module):
    """A Linear layer of a course's own, without bias: an einsum against its weight."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return torch.einsum("...i,oi->...o", x, self.weight)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, 64)
        self.linear1 = Linear(64, 128)
        self.linear2 = Linear(128, VOCABULARY)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.linear2(torch.relu(self.linear1(self.embedding(tokens))))


def batch(sequence: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    shape = (BATCH, sequence) if sequence else (BATCH,)
    draw = [torch.randint(0, VOCABULARY, shape, generator=generator) for _ in range(2)]
    return draw[0], draw[1]


def train(
    model: nn.Module, tokens: Tensor, targets: Tensor, synchronize: Synchronize
) -> list[State]:
    """SGD steps, `synchronize` after each backward; the parameters after each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    states = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), targets.reshape(-1))
        loss.backward()
        read = synchronize(model)
        optimizer.step()
        states.append(read())
    return states


def one_process(sequence: int) -> list[State]:
    torch.manual_seed(0)
    return train(Toy(), *batch(sequence), lambda model: lambda: snapshot(model))


def halves_added(sequence: int) -> None:
    """In one process: the two halves' gradients added against the whole batch's."""
    torch.manual_seed(0)
    model, (tokens, targets) = Toy(), batch(sequence)

    def gradients(rows: slice) -> State:
        model.zero_grad()
        logits = model(tokens[rows]).reshape(-1, VOCABULARY)
        nn.functional.cross_entropy(logits, targets[rows].reshape(-1)).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    half = BATCH // WORLD_SIZE
    whole, first, second = (
        gradients(slice(None)),
        gradients(slice(half)),
        gradients(slice(half, None)),
    )
    for name, gradient in whole.items():
        added = (first[name] + second[name]) / WORLD_SIZE
        difference = (gradient - added).abs().max().item()
        print(
            f"{'one process, halves added vs whole':40} gradient {name:17} "
            f"equal={torch.equal(gradient, added)!s:5} max diff {difference:.3g}"
        )


def snapshot(model: nn.Module) -> State:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def data_parallel_mean(model: nn.Module) -> Callable[[], State]:
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad.div_(WORLD_SIZE)
    return lambda: snapshot(model)


def fully_sharded_mean(model: nn.Module) -> Callable[[], State]:
    assert isinstance(model, FullyShardedDataParallel)
    model.finish_gradient_synchronization()
    return model.gather_full_params


def rank_main(rank: int, port: int, sequence: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    tokens, targets = (t.chunk(WORLD_SIZE)[rank] for t in batch(sequence))
    torch.manual_seed(0)
    bare = train(Toy(), tokens, targets, data_parallel_mean)
    torch.manual_seed(0)
    wrapped = FullyShardedDataParallel(Toy(), None, (nn.Embedding, Linear))
    sharded = train(wrapped, tokens, targets, fully_sharded_mean)
    if rank == 0:
        torch.save({"data parallel": bare, "fully sharded": sharded}, out)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def compare(name: str, ours: list[State], theirs: list[State]) -> None:
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for param in a:
            difference = (a[param] - b[param]).abs().max().item()
            equal = torch.equal(a[param], b[param])
            print(f"{name:40} step {step} {param:17} equal={equal!s:5} max diff {difference:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequence", type=int, default=0, help="tokens per row (0: one)")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    alone = one_process(args.sequence)
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "states.pt")
        mp.spawn(rank_main, (free_port(), args.sequence, out), nprocs=WORLD_SIZE)
        split = torch.load(out)
    compare("fully sharded vs one process", split["fully sharded"], alone)
    compare("data parallel vs one process", split["data parallel"], alone)
    compare("fully sharded vs data parallel", split["fully sharded"], split["data parallel"])
    halves_added(args.sequence)


if __name__ == "__main__":
    main()
