"""The migration toolkit: canary / shadow / fallback gateway, tiered comparator, compare and drill."""
