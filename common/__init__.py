"""Shared plumbing for the four algorithm scripts: model loaders, rewards, prompts, logging, ShapesBench.

Algorithm logic (samplers with log-probs, advantages, losses) deliberately lives in the scripts.
"""
