"""Gemma 3 and Gemma 4 text models in Flax NNX."""
