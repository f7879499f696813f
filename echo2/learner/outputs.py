"""What a run leaves behind: the final model, always, and optionally a push of it to the Hugging Face hub.

* The final model (or, for a LoRA policy, the adapter in PEFT's format) is saved with the trainer's own
  ``save_model`` into ``<run dir>/trainer``, as TRL's ``trainer.save_model()`` would: weights, config, tokenizer and
  chat template, loadable with ``from_pretrained`` (and by ``python -m echo2.eval``). It is saved whatever
  ``run.save_every_steps`` says (0, as the sweeps set it, only turns off the resumable checkpoints) and also when a
  signal stopped the run early. Every learner rank takes part (under ZeRO-3 the weights are gathered).
* ``run.push_to_hub``: the saved folder (less the checkpoints) is uploaded to ``run.hub_model_id`` with the trainer's
  ``push_to_hub`` (it writes TRL's model card and saves once more first), once, at the end. ``check_hub`` runs
  before the model loads, so a missing token or an unreachable hub fails the run at once rather than after hours of
  training; a push that fails at the end leaves the saved model and says how to upload it by hand.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class HubError(RuntimeError):
    """The hub push asked for cannot happen (no token, hub unreachable) or failed."""


def check_hub(cfg: Any) -> None:
    """Before anything loads: with ``run.push_to_hub``, a token must exist and the hub must answer with it."""
    if not cfg.run.push_to_hub:
        return
    from huggingface_hub import HfApi, get_token

    token = get_token()
    if not token:
        raise HubError(f"run.push_to_hub=true (to {cfg.run.hub_model_id}) but no hub token is set: export HF_TOKEN, "
                       "or run `hf auth login`")
    try:
        user = HfApi().whoami(token=token)
    except Exception as e:  # noqa: BLE001 - the network boundary: whatever stops the push, say so before training
        raise HubError(f"run.push_to_hub=true but the hub does not answer with this token ({type(e).__name__}: "
                       f"{e}); fix the network or the token, or run with run.push_to_hub=false and push later: "
                       f"hf upload {cfg.run.hub_model_id} <run dir>/trainer") from None
    log.info("hub: logged in as %s; the final model goes to %s", user.get("name", "?"), cfg.run.hub_model_id)


def save_final(trainer: Any) -> str:
    """Save the final model (every rank calls it); returns the folder."""
    folder = trainer.args.output_dir
    trainer.save_model()
    if trainer.is_world_process_zero():
        log.info("final model (step %d) saved in %s", trainer.state.global_step, folder)
    return folder


def push(trainer: Any, cfg: Any) -> None:
    """``run.push_to_hub``: upload the saved final model (every rank calls it). Raises HubError if it failed."""
    if not cfg.run.push_to_hub:
        return
    folder = trainer.args.output_dir
    try:
        commit = trainer.push_to_hub(commit_message=f"echo2: step {trainer.state.global_step}")
    except Exception as e:  # noqa: BLE001 - the network boundary: the model is saved; say how to push it by hand
        raise HubError(f"push of {folder} to {cfg.run.hub_model_id} failed ({type(e).__name__}: {e}). The model is "
                       f"saved; push it with: hf upload {cfg.run.hub_model_id} {folder} --exclude 'checkpoint-*'") \
            from None
    if trainer.is_world_process_zero():
        log.info("pushed to %s (%s)", cfg.run.hub_model_id, getattr(commit, "commit_url", commit))


def saved_files(folder: str | Path) -> list[str]:
    """The files of a saved model folder, less its checkpoints (what a push uploads)."""
    root = Path(folder)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and not p.relative_to(root).parts[0].startswith("checkpoint-"))
