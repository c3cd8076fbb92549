"""Ray start-up, rank layout, group-leader helpers and watchdog timeouts."""
