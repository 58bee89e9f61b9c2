"""Tree search strategies on a verifiable task (generated arithmetic problems)."""
