"""Cache tiers below the policy: RAM (in-process), SSD (persistent)."""
