"""Run by tests/learner/test_sharded_learner.py under torchrun with 2 processes (gloo): rank 0 holds a stub rollout source,
rank 1 none. A step's batch is handed out as whole groups per rank; then rank 0's source fails (a take timeout, then
a coordinator process dead past its restarts when the version advances) and every rank must raise, naming the
error, instead of waiting in a collective; a stop requested while rank 0 waits ends the run on every rank. Each
rank writes what it saw to OUT_DIR/rank<r>.json."""

import json
import os
import sys


class Stub:
    needs_policy = False
    check_every_steps = 0

    def __init__(self):
        self.calls = 0

    def collect(self, rows, version, policy=None):
        self.calls += 1
        if self.calls == 2:
            raise TimeoutError("only 3 of 4 admissible groups within 900 s (rollout.source.take_timeout_s)")
        if self.calls == 3:
            from echo2.seams import RunStopped

            raise RunStopped("stop requested while waiting for 4 rollout groups for step 3")
        return [f"g{i}" for i in range(len(rows))]

    def advance(self, version):
        from echo2.learner.sources.coordinator_process import CoordinatorDied

        raise CoordinatorDied("the coordinator process exited with code -9; it was restarted 3 times in the last "
                              "600 s: giving up")


def raised(call) -> str | None:
    """'TypeName: message' of what ``call()`` raised on this rank (None if it returned)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test compares what each rank saw
        return f"{type(e).__name__}: {e}"
    return None


def main(out_dir: str) -> None:
    from accelerate import PartialState

    from echo2.learner.distributed import ShardedSource

    state = PartialState(cpu=True)
    rank = state.process_index
    source = ShardedSource(Stub() if rank == 0 else None, rank, state.num_processes)
    seen = {"slice": source.collect([{"row": 0}, {"row": 1}], 0), "batch": source.last_batch}
    seen["error"] = raised(lambda: source.collect([{"row": 0}, {"row": 1}], 1))
    seen["version_error"] = raised(lambda: source.on_version(2, weights=None))
    seen["stop"] = raised(lambda: source.collect([{"row": 0}, {"row": 1}], 2))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
