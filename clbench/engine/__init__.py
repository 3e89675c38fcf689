"""The shared training engine: models, rollouts, log-probs, losses, teachers."""
