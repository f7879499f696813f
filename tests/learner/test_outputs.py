"""What a run leaves: the final model, saved whatever run.save_every_steps says; a hub push when asked, tested at
the hub's boundary (no network): its upload, its failure, and the checks that fail a run before it trains."""

from __future__ import annotations

import types

import pytest
import torch
from trl import GRPOTrainer  # noqa: F401 (here, at collection: its first import probes the platform)

from conftest import build_run, compose
from echo2.config import ConfigError, validate
from echo2.learner import outputs


class FakeHub:
    """transformers' ``hf_api()`` at the boundary: records the repository it creates and the folder it uploads."""

    def __init__(self, fail: Exception | None = None):
        self.fail, self.created, self.uploaded = fail, [], []

    def __call__(self):
        return self

    def create_repo(self, repo_id, token=None, private=None, exist_ok=False):
        self.created.append((repo_id, private))
        return types.SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, commit_message, token=None, run_as_future=False,
                      ignore_patterns=(), revision=None):
        if self.fail:
            raise self.fail
        from pathlib import Path

        files = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        self.uploaded.append((repo_id, folder_path, files, list(ignore_patterns), commit_message))
        return types.SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/1")


def trained(tmp_path, extra=()):
    cfg, trainer, source, _ = build_run(tmp_path, ["rollout=sync", "run.steps=2", "rollout.prompts_per_step=4",
                                                   "run.save_every_steps=0", *extra])
    trainer.train()
    return cfg, trainer


def test_the_final_model_is_saved_without_checkpoints_and_loads(tmp_path):
    """run.save_every_steps=0: no checkpoint, but save_final leaves a model from_pretrained loads, with the trained
    weights and the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, trainer = trained(tmp_path)
    folder = outputs.save_final(trainer)
    assert folder == str(tmp_path / "trainer") and not list((tmp_path / "trainer").glob("checkpoint-*"))
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for (name, p), q in zip(trainer.model.named_parameters(), loaded.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
    assert AutoTokenizer.from_pretrained(folder).pad_token_id == trainer.processing_class.pad_token_id


def test_push_uploads_the_final_model_once(tmp_path, monkeypatch):
    import transformers.trainer

    hub = FakeHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", hub)
    cfg, trainer = trained(tmp_path, ["run.push_to_hub=true", "run.hub_model_id=me/echo2-tiny", "run.hub_private=true"])
    folder = outputs.save_final(trainer)
    outputs.push(trainer, cfg)
    assert hub.created == [("me/echo2-tiny", True)]
    [(repo, uploaded_from, files, ignored, message)] = hub.uploaded
    assert repo == "me/echo2-tiny" and uploaded_from == folder and "checkpoint-*" in ignored
    assert {"model.safetensors", "config.json", "README.md"} <= set(files) and message == "echo2: step 2"


def test_a_failed_push_keeps_the_model_and_says_how_to_push_it(tmp_path, monkeypatch):
    import transformers.trainer

    monkeypatch.setattr(transformers.trainer, "hf_api", FakeHub(fail=ConnectionError("no route to host")))
    cfg, trainer = trained(tmp_path, ["run.push_to_hub=true", "run.hub_model_id=me/echo2-tiny"])
    folder = outputs.save_final(trainer)
    with pytest.raises(outputs.HubError, match=r"no route to host.*hf upload me/echo2-tiny .*trainer"):
        outputs.push(trainer, cfg)
    assert (tmp_path / "trainer" / "model.safetensors").is_file() and folder.endswith("trainer")


def test_the_hub_is_checked_before_anything_loads(monkeypatch):
    """No token, or a hub that does not answer: the run fails before the model loads; HF_HUB_OFFLINE or no
    repository: the config is refused."""
    import huggingface_hub

    cfg = compose(["run.push_to_hub=true", "run.hub_model_id=me/x"])
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(outputs.HubError, match="no hub token is set: export HF_TOKEN"):
        outputs.check_hub(cfg)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_fake")

    def offline(self, token=None):
        raise ConnectionError("huggingface.co unreachable")

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", offline)
    with pytest.raises(outputs.HubError, match="does not answer with this token.*unreachable"):
        outputs.check_hub(cfg)
    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", lambda self, token=None: {"name": "me"})
    outputs.check_hub(cfg)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        validate(cfg)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(ConfigError, match="needs run.hub_model_id"):
        validate(compose(["run.push_to_hub=true"]))
