"""Routing requests over several backends: policies (``policy``), block indexes (``kv_index``)."""
