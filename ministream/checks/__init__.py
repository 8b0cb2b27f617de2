"""Checks across vLLM releases: the static matrix, each line run for real, vLLM's own tests, their report."""
