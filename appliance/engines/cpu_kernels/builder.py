"""Compile a CPU kernel's C source with the host's compiler, once per source and processor.

Why at run time, on the host: the kernels use the processor's vector instructions
(``-march=native``), and the appliance ships as one binary to boxes whose CPUs the build
machine never saw. The shared library is cached under a name that hashes the source (and
the headers beside it, and a source it includes), the compiler, its flags and the processor's feature flags, so a box
compiles once (well under a second) and a changed CPU or source compiles again. No compiler, or a processor without the
instructions (the compile fails): the caller gets `KernelUnavailable` with one line, and
the engine keeps torch's path.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from appliance.engines.dtypes import cpu_flags

__all__ = ["FLAGS", "KernelUnavailable", "build", "cache_dir", "compiler"]

SOURCE_DIR = Path(__file__).resolve().parent
# -ffp-contract=off: a kernel rounds where its source says (gcc would otherwise fuse a
# multiply and an add into one FMA, rounding once where torch's ops round twice).
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120.0


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why, in one line."""


def compiler() -> str | None:
    """The C compiler: $CC, else `cc`, else `gcc` on the PATH."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shutil.which(cc) or (cc if Path(cc).is_file() else None)
    return shutil.which("cc") or shutil.which("gcc")


def cache_dir(configured: str = "") -> Path:
    """Where built kernels are kept: `configured` (the daemon gives its state directory's
    ``kernels/``), else $XDG_CACHE_HOME/applianced/kernels (~/.cache when unset)."""
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "applianced" / "kernels"


def build(name: str, directory: Path, cc: str | None = None,
          flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared library of ``<name>.c`` (beside this file), compiled into `directory`
    unless a build of the same source, compiler, flags and processor is there already.
    (Tests pass `flags` with an instruction set turned off, to run the code a CPU without
    it would.)"""
    source = SOURCE_DIR / f"{name}.c"
    try:
        text = source.read_bytes()
    except OSError as exc:
        raise KernelUnavailable(f"no source for kernel {name}: {exc}") from None
    cc = cc or compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler (cc, gcc or $CC) on this host")
    headers = [h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h"))]   # what it includes
    # a source that includes another (decode_layers_f32.c: decode_layers.c) hashes it too
    for other in re.findall(rb'^#include "([\w.]+\.c)"', text, re.M):
        headers.append((SOURCE_DIR / other.decode()).read_bytes())
    cpu = " ".join(sorted(cpu_flags())) or os.uname().machine
    key = hashlib.sha256(b"\0".join([text, *headers, cc.encode(), " ".join(flags).encode(),
                                     cpu.encode()])).hexdigest()[:16]
    target = directory / f"{name}-{key}.so"
    if target.is_file():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=directory)
        os.close(fd)
    except OSError as exc:
        raise KernelUnavailable(f"cannot write kernels to {directory}: {exc}") from None
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(source)], capture_output=True,
                              text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if "error" in ln] or \
                done.stderr.splitlines() or [f"exit status {done.returncode}"]
            raise KernelUnavailable(f"{Path(cc).name} could not build kernel {name}: "
                                    f"{lines[0].strip()}")
        os.replace(tmp, target)     # atomic: a worker starting beside us sees all or nothing
    except subprocess.TimeoutExpired:
        raise KernelUnavailable(f"building kernel {name} took over {COMPILE_TIMEOUT_S:.0f} s") \
            from None
    except OSError as exc:
        raise KernelUnavailable(f"cannot run {cc}: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
