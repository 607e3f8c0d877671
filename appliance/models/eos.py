"""A checkpoint's end-of-sequence token ids, as its own files declare them.

Below the engines and the worker: every engine reads it, and nothing here knows of either.
"""
from __future__ import annotations

import json
from pathlib import Path


def read_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """`eos_token_id` from generation_config.json, else config.json (an int or a list);
    () when neither says."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()
