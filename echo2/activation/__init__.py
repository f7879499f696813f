"""Cost-aware activation of priced rollout workers (docs/design.md §4): ``solve`` (exact, greedy, all_on) and
``online`` (re-planning with hysteresis). Pure: no sockets, threads or torch."""
