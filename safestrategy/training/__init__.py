"""Everything after the strategy is built: the stall watchdog, the peers' verdict, the canary."""
