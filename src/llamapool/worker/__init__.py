"""Worker: one process per device; owns one model, one context and the engine thread."""
