"""Supervisor: the main process. Finds GPUs with NVML, spawns and watches one worker per device."""
