"""The single binary (`make binary` -> dist/applianced/): what it holds, and that it
serves. Skipped when no binary was built (`.ci/run` builds one before `make test`)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time

import pytest

from helpers.daemons import ROOT, free_port, http, pid_alive

from appliance.cli import AREAS

DIST = ROOT / "dist" / "applianced"
BINARY = DIST / "applianced"
DRIVER_LIBS = re.compile(r"^lib(cuda|nvidia-ml)\.so")

pytestmark = pytest.mark.skipif(not BINARY.exists(), reason="no dist/applianced: run make binary")


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_bundle_has_no_driver_libraries_and_a_cpu_torch():
    files = [p for p in DIST.rglob("*") if p.is_file() or p.is_symlink()]
    assert len(files) > 100
    assert not [p for p in files if DRIVER_LIBS.match(p.name)]
    torch_libs = {p.name for p in (DIST / "_internal" / "torch" / "lib").iterdir()}
    assert any(n.startswith("libtorch_cpu") for n in torch_libs)
    assert not any(n.startswith(("libtorch_cuda", "libcudart", "libnccl")) for n in torch_libs)


def test_bundle_carries_textual_widgets_stylesheets_and_the_corpus():
    readers = pytest.importorskip("PyInstaller.archive.readers")
    modules = set(readers.pkg_archive_contents(str(BINARY), recursive=True))
    assert {"textual.widgets", "textual.widgets._data_table", "appliance.cli",
            "appliance.worker.main", "appliance.engines.torch_engine"} <= modules
    assert not {m for m in modules if m.split(".")[0] in ("transformers", "pytest", "openai")}
    for tcss in ROOT.joinpath("appliance").rglob("*.tcss"):
        assert (DIST / "_internal" / tcss.relative_to(ROOT)).is_file(), tcss
    assert (DIST / "_internal" / "stdlib_corpus").is_dir()
    # the C kernels' sources, which the worker compiles on the box (engines/cpu_kernels)
    sources = sorted([*ROOT.joinpath("appliance").rglob("*.c"), *ROOT.joinpath("appliance").rglob("*.h")])
    assert sources
    for source in sources:
        assert sha256(DIST / "_internal" / source.relative_to(ROOT)) == sha256(source), source


def test_binary_serves_the_cpu_default_and_stops_on_sigterm(tmp_path, tiny_model):
    port = free_port()
    state = tmp_path / "state"
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(BINARY), "serve", "--port", str(port), "--state-dir", str(state)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        code = None
        while time.monotonic() < deadline and code != 200 and proc.poll() is None:
            try:
                code, _, _ = http("GET", f"http://127.0.0.1:{port}/ready", timeout=2)
            except OSError:
                time.sleep(0.2)
        assert code == 200, log.read_text()
        # It made the same default model as the source tree makes (same tokenizer corpus).
        made = state / "models" / "tiny-llama"
        for name in ("tokenizer.json", "model.safetensors", "config.json"):
            assert sha256(made / name) == sha256(tiny_model / name), name

        import openai
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny-llama", max_tokens=8,
                                           messages=[{"role": "user", "content": "Hello"}])
        assert r.usage.completion_tokens == 8 and r.choices[0].message.content

        out = subprocess.run([str(BINARY), "status", "--url", f"http://127.0.0.1:{port}"],
                             capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "tiny-llama" in out.stdout and "torch" in out.stdout
        out = subprocess.run([str(BINARY), "status", "--json", "--url", f"http://127.0.0.1:{port}"],
                             capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        shown = json.loads(out.stdout)
        assert (shown["model"], shown["engine"], shown["ready"], shown["simulated"]) == \
            ("tiny-llama", "torch", True, False)
        _, _, status = http("GET", f"http://127.0.0.1:{port}/admin/v1/status")
        workers = [w["pid"] for w in status["workers"]]
        assert len(workers) == 2
        for pid in workers:     # workers are this same binary, not a Python somewhere
            assert os.readlink(f"/proc/{pid}/exe") == str(BINARY.resolve())
            assert open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[1] == b"worker"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif("tui" not in AREAS, reason="this checkout has no `tui` command yet")
def test_binary_runs_the_tui_in_a_terminal(tmp_path, tiny_model):
    """The Textual console from the binary (widgets and stylesheets collected), in a real
    pseudo-terminal against a running appliance: it draws, and `q` quits it."""
    import pty
    import select

    from helpers.daemons import start_daemon
    d = start_daemon(tmp_path / "d", tiny_model, "--devices", "sim:2xH100", "--engine", "sim")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TERM="xterm-256color", COLUMNS="120", LINES="40")
    pid, fd = pty.fork()
    if pid == 0:     # the child: the binary's TUI on the pty
        os.execve(str(BINARY), [str(BINARY), "tui", "--url", d.url], env)
    try:
        screen = b""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and b"tiny-llama" not in screen:
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    screen += os.read(fd, 65536)
                except OSError:
                    break
        assert b"tiny-llama" in screen, screen[-2000:]
        assert b"Traceback" not in screen
        os.write(fd, b"q")
        deadline = time.monotonic() + 20
        status = None
        while time.monotonic() < deadline:
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    os.read(fd, 65536)
                except OSError:
                    pass
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
        assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
        d.stop()


NIXL_PLUGIN = DIST / "_internal" / "nixl_cu12.libs" / "nixl" / "libplugin_UCX.so"
CLUSTER = '[cluster]\nrole = "decode"\npeers = ["http://127.0.0.1:9"]\nkey = "{key}"\n'


@pytest.mark.skipif(not NIXL_PLUGIN.exists(),
                    reason="the binary was built without NIXL (no nixl-cu12 in the build's venv)")
def test_binary_carries_nixl_and_a_decode_box_starts(tmp_path):
    """NIXL inside the binary (issue 29): its UCX backend plugin and UCX's transports are
    bundled, found at run time (nixl_transport points NIXL_PLUGIN_DIR and UCX_MODULE_DIR
    at them), and move bytes: `config check` of a decode box's config does a loopback
    NIXL READ, byte-exact; then the binary serves with `[cluster] role = "decode"`."""
    assert not list(NIXL_PLUGIN.parent.glob("libplugin_[!U]*"))     # the UCX backend only
    assert any((DIST / "_internal" / "nixl_cu12.libs" / "ucx").glob("libuct_cma.so*"))
    assert not (DIST / "_internal" / "nixl_ep_cu12").exists()
    cfg = tmp_path / "decode.toml"
    cfg.write_text(CLUSTER.format(key="k" * 24))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "NIXL_PLUGIN_DIR", "UCX_MODULE_DIR")}
    out = subprocess.run([str(BINARY), "config", "check", str(cfg)], capture_output=True,
                         text=True, env=env, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{cfg}: ok; NIXL read 128 KiB between two local agents "
                                 "over UCX, exact, in "), out.stdout

    port = free_port()
    log = tmp_path / "log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([str(BINARY), "serve", "--config", str(cfg), "--port", str(port),
                                 "--state-dir", str(tmp_path / "state"), "--devices", "sim:2xH100",
                                 "--engine", "sim"],
                                stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        code = None
        while time.monotonic() < deadline and code != 200 and proc.poll() is None:
            try:
                code, _, _ = http("GET", f"http://127.0.0.1:{port}/ready", timeout=2)
            except OSError:
                time.sleep(0.2)
        assert code == 200, log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
