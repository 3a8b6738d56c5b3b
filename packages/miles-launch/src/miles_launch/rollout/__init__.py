"""Rollout: prompts, generation against the engines, rewards, dynamic filtering."""
