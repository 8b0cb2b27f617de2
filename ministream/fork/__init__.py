"""The vLLM side: release artifacts, registries, patch sets, the patched tree, wheel, install, image."""
