"""A CPU kernel built from another copy of its C source (`--against OLD.c` in the kernel
benchmarks), with this tree's headers and the flags the engine builds with, so the two
builds differ only by the source."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from appliance.engines.cpu_kernels import builder  # noqa: E402


def build_against(source: Path, directory: Path, cls):
    """`cls` (a `cpu_kernels` wrapper: PagedDecode, LinearBf16...) over `source` compiled
    into `directory`."""
    out = directory / f"{source.stem}-against.so"
    subprocess.run([builder.compiler() or "cc", *builder.FLAGS, f"-I{builder.SOURCE_DIR}",
                    "-o", str(out), str(source)], check=True)
    return cls(out)
