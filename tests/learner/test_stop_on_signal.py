"""StopOnSignal: a signal to one learner rank stops every rank after the same step, whenever it lands: two ranks
run the callback in lockstep threads through a real two-party vote (a barrier standing in for the all-reduce)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch
from transformers import TrainerControl

from echo2.learner.callbacks import StopOnSignal


class Vote:
    """The sum all-reduce of two ranks: each waits until both flags are in (a broken barrier: a rank left alone)."""

    def __init__(self):
        self.flags = [0.0, 0.0]
        self.barrier = threading.Barrier(2, timeout=10)

    def accelerator(self, rank: int, on_wait=None) -> SimpleNamespace:
        def reduce(flag: torch.Tensor, reduction: str) -> torch.Tensor:
            assert reduction == "sum"
            self.flags[rank] = flag.item()
            self.barrier.wait()
            total = sum(self.flags)
            if on_wait:
                on_wait()  # a signal handled while this rank was still inside the collective
            self.barrier.wait()
            return torch.tensor([total])

        return SimpleNamespace(device=torch.device("cpu"), reduce=reduce)


def run_ranks(signal_rank: int, signal_step: int, during_vote: bool, steps: int = 6, mu: int = 1) -> dict[int, tuple]:
    vote, stopped = Vote(), {}
    callbacks = {}

    def rank_loop(rank: int) -> None:
        def deliver():
            if rank == signal_rank and step == signal_step:
                callbacks[rank].requested = "SIGTERM"

        callbacks[rank] = StopOnSignal(SimpleNamespace(accelerator=vote.accelerator(
            rank, on_wait=deliver if during_vote else None), num_iterations=mu))
        args = SimpleNamespace(world_size=2, save_strategy="no")
        for step in range(1, steps + 1):
            if not during_vote:
                deliver()  # the signal lands during the step, before its vote
            control = TrainerControl()
            callbacks[rank].on_step_end(args, SimpleNamespace(global_step=step), control)
            if control.should_training_stop:
                stopped[rank] = (step, callbacks[rank].requested)
                return
        stopped[rank] = (None, callbacks[rank].requested)

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return stopped


def test_a_signal_during_a_step_stops_every_rank_after_that_step():
    stopped = run_ranks(signal_rank=1, signal_step=3, during_vote=False)
    assert stopped == {0: (3, "stopped by another learner rank"), 1: (3, "SIGTERM")}


def test_a_signal_handled_inside_the_vote_stops_every_rank_after_the_next_step():
    """The race a CI run hit: rank 1 waited in the vote when SIGTERM came; it must not stop alone (rank 0, which
    voted 'go on', would wait in the next step's collective forever)."""
    for signal_rank in (0, 1):
        stopped = run_ranks(signal_rank=signal_rank, signal_step=3, during_vote=True)
        assert set(stopped) == {0, 1}, f"a rank was left waiting in the vote: {stopped}"
        assert stopped[0][0] == stopped[1][0] == 4, stopped
        assert stopped[signal_rank][1] == "SIGTERM" and stopped[1 - signal_rank][1] == "stopped by another learner rank"


def test_with_several_passes_per_batch_the_stop_waits_for_the_batch_to_end():
    """learner.num_iterations = 3: a signal at step 4 (the first pass over the batch taken at version 3) stops both
    ranks after step 6, its last pass: checkpoints and resumes lie between batches."""
    stopped = run_ranks(signal_rank=0, signal_step=4, during_vote=False, steps=9, mu=3)
    assert stopped == {0: (6, "SIGTERM"), 1: (6, "stopped by another learner rank")}
