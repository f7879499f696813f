"""Cost-aware activation of priced rollout workers (DESIGN §5). Not built yet: nothing here runs."""
