"""Cost-aware activation of priced rollout workers (DESIGN §5): ``solve`` (exact, greedy, all_on) and
``online`` (re-planning with hysteresis). Pure: no sockets, threads or torch."""
