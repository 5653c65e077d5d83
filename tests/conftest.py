"""Shared test set-up: offline hub, quiet tokenizers, and the toy task built once."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tiny models on 2 shared cores: one torch thread each is ~30x faster than two threads
# spinning against each other and the server (measured in the hf backend: 19 vs 711 ms
# per call under load).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
