"""Learning plane: TRL's GRPOTrainer fed by a ``RolloutSource`` (``trainer.py``), its off-policy corrections
(``corrections.py``), its config (``args.py``), and the per-step callbacks (``callbacks.py``)."""
