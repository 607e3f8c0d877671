"""The workflow journal across processes: one killed inside a write transaction loses
nothing committed, and a worker that outlived its daemon is killed by the next one."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from appliance.workflows.journal import Journal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_process_killed_mid_transaction_loses_nothing_committed(tmp_path):
    """A child commits one workflow, then is SIGKILLed inside an open write transaction
    (intent written, not committed). Reopened, the journal has the committed workflow
    and none of the torn write, and it is writable again (the lock died with the child)."""
    path = tmp_path / "wf.db"
    child = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {ROOT!r})
        from appliance.workflows.journal import Journal
        j = Journal({str(path)!r})
        wf = j.create("repartition", "workers", {{"split": "6+2"}}, ["validate", "stop"])
        print(wf.id, flush=True)
        j.db.execute("BEGIN IMMEDIATE")
        j.db.execute("UPDATE steps SET status = 'running', intent = '{{}}' WHERE workflow_id = ?",
                     (wf.id,))
        j.db.execute("INSERT INTO state VALUES ('partition', '{{}}', NULL, 0)")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    wid = proc.stdout.strip()
    j = Journal(path)
    wf = j.get(wid)
    assert wf.params == {"split": "6+2"}
    assert [s.status for s in wf.steps] == ["pending", "pending"]
    assert j.get_state("partition") is None
    j.step_intent(wid, 0, {"again": True})
    assert j.get(wid).steps[0].intent == {"again": True}


def test_a_surviving_worker_of_a_dead_daemon_is_killed():
    """The start-up check behind PR_SET_PDEATHSIG: a recorded worker pid that still runs
    `applianced worker` with that name is killed; an unrelated live pid is left alone."""
    from appliance.daemon.control import kill_orphans
    spec = '{"worker":"decode9","role":"decode"}'
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                               "worker", "--spec", spec])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        killed = kill_orphans([("decode9", orphan.pid, ["sim4"], 1),
                               ("decode8", other.pid, ["sim5"], 1),
                               ("decode7", 2 ** 22 + 7, ["sim6"], 1)])
        assert killed == [{"worker": "decode9", "pid": orphan.pid, "devices": ["sim4"]}]
        assert orphan.wait(10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for p in (orphan, other):
            if p.poll() is None:
                p.kill()
                p.wait()
