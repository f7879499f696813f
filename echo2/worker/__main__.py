"""``python -m echo2.worker``: start a rollout worker agent (see echo2/worker/agent.py)."""

from echo2.worker.agent import main

if __name__ == "__main__":
    main()
